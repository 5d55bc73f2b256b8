"""Multi-token prediction (`model.mtp_layers`): its loss equals a written-out
computation, it trains under ddp, expert parallelism, a sequence split and pipeline
stages as one device does, generation never runs it, and its router biases follow
their own counts; each with a companion that breaks it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmoe
from jaxmoe.config import ConfigError, config_from_dict
from jaxmoe.generate import generate
from jaxmoe.parallel.layout import DeviceLayout

from one_device import batch, first_step, matches

N = 2  # prediction depths
BASE = {
    "model": {"d_model": 32, "num_layers": 3, "num_dense_layers": 1, "mlp_hidden": 64,
              "attention": "mla", "qk_norm": "none", "num_heads": 4, "num_kv_heads": 4,
              "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
              "qk_rope_head_dim": 4, "v_head_dim": 6, "rope_interleave": True, "mtp_layers": N},
    # DeepSeek-V3's router; capacity for every copy, as the one-device reference
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "capacity_factor": 8.0,
            "shared_expert_hidden": 32, "score_func": "sigmoid", "expert_bias": True,
            "routing_groups": 4, "groups_per_token": 2, "gate_scale": 2.5,
            "bias_update_rate": 0.01, "balance_scope": "sequence"},
    "train": {"steps": 10, "batch_size": 8, "seq_len": 32, "mtp_loss_weight": 0.3},
    "optimizer": {"warmup_steps": 0, "learning_rate": 1e-2, "grad_clip": 0.0},
}


def _cfg(mesh, dispatcher="dense", model=None, pipeline=None, train=None):
    return config_from_dict({**BASE, "model": {**BASE["model"], **(model or {})}, "mesh": mesh,
                             "moe": {**BASE["moe"], "dispatcher": dispatcher},
                             "pipeline": pipeline or {},
                             "train": {**BASE["train"], **(train or {})}})


@pytest.fixture(scope="module")
def one_device():
    return first_step(_cfg({"data": 1}))


def _norm(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _written_out(params, cfg, tokens_BxL1, count_all=False, swap=False):
    """Each depth's mean cross-entropy, from the model's pieces: its hidden state, each
    module's norms, projection and transformer layer, its norm and the shared head, in
    float64 NumPy where it is not a layer. count_all / swap: the wrong mask (targets
    past the row's end counted as token 0) / [hidden; embedding] order."""
    model = jaxmoe.api.to_module(params, cfg)
    B, L1 = tokens_BxL1.shape
    L = L1 - 1
    h, _ = model.hidden(jnp.asarray(tokens_BxL1[:, :L]))
    padded = np.pad(tokens_BxL1, ((0, 0), (0, N)))
    embed, head = np.asarray(params["embed"], np.float64), np.asarray(params["head"], np.float64)
    graphdef, state = nnx.split(model.mtp_layers)
    ces = []
    for d in range(1, N + 1):
        module = nnx.merge(graphdef, jax.tree.map(lambda a: a[d - 1], state))  # noqa: B023
        p = jax.tree.map(lambda a: np.asarray(a[d - 1], np.float64), params["mtp_layers"])  # noqa: B023
        e = _norm(embed[padded[:, d:d + L]], p["embed_norm"]["scale"])
        hn = _norm(np.asarray(h, np.float64), p["hidden_norm"]["scale"])
        joined = np.concatenate([hn, e] if swap else [e, hn], axis=-1)
        x = joined @ p["proj"]
        h, _ = module.block(jnp.asarray(x, jnp.float32),
                            jnp.broadcast_to(jnp.arange(L), (B, L)))
        logits = _norm(np.asarray(h, np.float64), p["out_norm"]["scale"]) @ head
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                               keepdims=True)) - logits.max(-1, keepdims=True)
        targets = padded[:, d + 1:d + 1 + L]
        nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
        counted = slice(None) if count_all else slice(0, L - d)
        ces.append(nll[:, counted].mean())
    return np.array(ces)


def test_the_loss_equals_a_written_out_computation():
    cfg = jaxmoe.api.local_config(_cfg({"data": 1}))
    params = jaxmoe.init(cfg, jax.random.PRNGKey(3))
    tokens = batch(cfg)
    model = jaxmoe.api.to_module(params, cfg)
    h, _ = model.hidden(jnp.asarray(tokens[:, :-1]))
    got, aux = model.mtp_losses(h, jnp.pad(jnp.asarray(tokens), ((0, 0), (0, N))))
    want = _written_out(params, cfg, tokens)
    # fp32 against float64 over 32-wide sums and a 256-way softmax: ~1e-6 relative
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)
    assert aux["counts"].shape == (N, 8)  # each module's MoE layer reports its routing
    # companions: the padded targets counted, or the halves of the projection's input
    # swapped, are other numbers
    for wrong in (_written_out(params, cfg, tokens, count_all=True),
                  _written_out(params, cfg, tokens, swap=True)):
        assert np.abs(wrong - want).min() > 1e-3


def test_the_step_adds_the_weighted_mean_and_logs_each_depth(one_device):
    metrics = one_device[0]
    moe, t = BASE["moe"], BASE["train"]
    assert metrics["mtp_ce_depth"].shape == (N,)
    np.testing.assert_allclose(metrics["mtp_ce"], metrics["mtp_ce_depth"].mean(), rtol=1e-6)
    z_weight = jaxmoe.config_from_dict({}).moe.z_loss_weight
    balance_weight = jaxmoe.config_from_dict({}).moe.balance_loss_weight
    want = (metrics["ce"] + t["mtp_loss_weight"] * metrics["mtp_ce"]
            + balance_weight * metrics["balance_loss"] + z_weight * metrics["z_loss"])
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-6)
    # the router stats cover the MoE layers, then the modules' layers
    assert metrics["expert_load"].shape == (2 + N, moe["num_experts"])
    assert abs(metrics["mtp_ce"] - metrics["ce"]) > 1e-3  # not the main loss again


@pytest.mark.parametrize("mesh, dispatcher, pipeline, train", [
    ({"data": 2, "expert": 4}, "alltoall", None, None),
    # recomputed layers, and the head 8 positions at a time (the mask cut with them)
    ({"data": 2, "context": 2, "expert": 2}, "ragged", None, {"remat": "full", "loss_chunk": 8}),
    ({"data": 1, "stage": 2, "expert": 4}, "alltoall", {"stage_microbatches": 2}, None),
    # 1F1B: the modules run in the last chunk's backward, each micro-batch's own
    ({"data": 1, "context": 2, "stage": 2, "expert": 2}, "alltoall",
     {"stage_microbatches": 2, "schedule": "1f1b"}, {"remat": "full"}),
])
def test_trains_as_one_device(one_device, mesh, dispatcher, pipeline, train):
    got = first_step(_cfg(mesh, dispatcher, pipeline=pipeline, train=train))
    np.testing.assert_allclose(got[0]["mtp_ce_depth"], one_device[0]["mtp_ce_depth"], rtol=1e-5)
    matches(got, one_device)


def test_a_sequence_split_that_counts_by_its_chunk_is_caught(one_device, monkeypatch):
    """Companion: each chunk taking its own length for the row's (so that it counts
    targets past the row's end, or drops some inside it) is caught."""
    monkeypatch.setattr(DeviceLayout, "sequence_length", lambda self, length: length)
    got = first_step(_cfg({"data": 2, "context": 2, "expert": 2}, "ragged"))
    assert np.abs(got[0]["mtp_ce_depth"] - one_device[0]["mtp_ce_depth"]).max() > 1e-3


def test_the_modules_routers_follow_their_own_load(one_device):
    metrics, _, _, buffers = one_device
    rate = BASE["moe"]["bias_update_rate"]
    load = metrics["expert_load"]  # [MoE layers + N, E], from the step's counts
    want = rate * np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_allclose(buffers["mtp_layers"]["block"]["moe"]["router"]["bias"],
                               want[2:], atol=1e-7)
    np.testing.assert_allclose(buffers["moe_layers"]["moe"]["router"]["bias"], want[:2],
                               atol=1e-7)
    assert np.any(want[1] != want[2])  # companion: the last MoE layer's load is another


def test_generation_never_runs_the_modules():
    cfg = jaxmoe.api.local_config(_cfg({"data": 1}))
    params = jaxmoe.init(cfg, jax.random.PRNGKey(1))
    plain = jaxmoe.api.local_config(_cfg({"data": 1}, model={"mtp_layers": 0}))
    without = {k: v for k, v in params.items() if k != "mtp_layers"}
    tokens = np.random.default_rng(0).integers(0, 256, (2, 10))
    got, _ = jaxmoe.apply(params, tokens, cfg)
    want, _ = jaxmoe.apply(without, tokens, plain)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    text = generate(params, tokens, cfg, key=jax.random.key(0), max_new_tokens=4,
                           temperature=0.0)
    np.testing.assert_array_equal(
        np.asarray(text), np.asarray(generate(without, tokens, plain,
                                                     key=jax.random.key(0), max_new_tokens=4,
                                                     temperature=0.0)))
    # companion: a model whose main weights differ gives other logits
    other = {**without, "head": without["head"] * 1.5}
    assert np.abs(np.asarray(jaxmoe.apply(other, tokens, plain)[0]) - np.asarray(want)).max() \
        > 1e-3


def test_the_settings_are_checked():
    with pytest.raises(ConfigError, match="model.mtp_layers"):
        _cfg({"data": 1}, model={"mtp_layers": 32})
    with pytest.raises(ConfigError, match="train.mtp_loss_weight"):
        config_from_dict({**BASE, "train": {**BASE["train"], "mtp_loss_weight": -1.0}})


def test_the_safetensors_export_names_each_module():
    from jaxmoe.plan.counts import param_counts
    from jaxmoe.export import named_tensors
    from jaxmoe.model.transformer import Transformer

    cfg = _cfg({"data": 1})
    params = nnx.state(nnx.eval_shape(lambda: Transformer.of(cfg, nnx.Rngs(0))), nnx.Param)
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), params)
    tensors = named_tensors(params, cfg)
    D = BASE["model"]["d_model"]
    assert {f"mtp.{i}.proj" for i in range(N)} <= set(tensors)
    assert tensors["mtp.1.proj"][0].shape == (2 * D, D)
    assert tensors["mtp.0.block.moe.experts.w_down"][1] == ["experts", "expert_mlp", "embed"]
    assert sum(v.size for v, _ in tensors.values()) == param_counts(cfg).total


PIPELINE = ({"data": 1, "stage": 2, "expert": 4}, "alltoall", {"stage_microbatches": 2})


def _lm_head_flops(cfg, monkeypatch=None, whole_rows=False):
    """The LM head's FLOPs (the main head and the MTP modules') in the step XLA:CPU
    compiles for `cfg`, per device; whole_rows: every stage runs all its rows."""
    from jaxmoe.plan.hlo import Program
    from jaxmoe.step.program import DeviceProgram
    from jaxmoe.plan.program_flops import program_flops
    from jaxmoe.parallel.sharding import make_mesh
    from jaxmoe.step import build_steps

    if whole_rows:
        monkeypatch.setattr(DeviceProgram, "_loss_layout", lambda self: self.layout)
    steps = build_steps(cfg, make_mesh(cfg.mesh, jax.devices()[:8]))
    state = steps.init(jax.random.PRNGKey(0))
    rows = jax.device_put(batch(cfg), steps.batch_sharding)
    program = Program(steps.train_step.lower(state, rows).compile().as_text())
    return program_flops(program).total("lm_head")


def test_stages_share_the_work_outside_the_pipeline(one_device, monkeypatch):
    """Under pipeline stages each stage runs the embedding, dense layers, head and
    MTP modules on its half of the device's rows (`StageRowsLayout`): half the head's
    FLOPs of every stage running all of them, with the one-device step's numbers
    (`test_trains_as_one_device`). Companion: stages that each take the first half
    instead of their own miss half the rows, and the step differs."""
    from jaxmoe.parallel.layout import StageRowsLayout

    cfg = _cfg(*PIPELINE[:2], pipeline=PIPELINE[2])
    shared = _lm_head_flops(cfg)
    with monkeypatch.context() as m:
        whole = _lm_head_flops(cfg, m, whole_rows=True)
    assert whole == pytest.approx(2 * shared, rel=1e-6)
    monkeypatch.setattr(StageRowsLayout, "rows_outside_stack",
                        lambda self, rows: rows[:rows.shape[0] // self.stages])
    got = first_step(cfg)
    assert abs(got[0]["ce"] - one_device[0]["ce"]) > 1e-4
