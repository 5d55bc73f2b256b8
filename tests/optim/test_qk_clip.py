"""QK-clip (`optimizer.qk_clip`): each head's largest causal logit measured as written
out, exactly the heads over the threshold rescaled (grouped-query and MLA), the step
applying it after the update, and every mesh clipping as one device does; each with
a companion that breaks it."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmoe
from jaxmoe.config import ConfigError, config_from_dict
from jaxmoe.model.attention import MAX_LOGIT, Attention, max_logits
from jaxmoe.model.mla import LatentAttention
from jaxmoe.optim import qk_clip
from jaxmoe.parallel.sharding import AXES, make_mesh
from jaxmoe.step import build_steps

from model_order import in_model_order
from one_device import batch

GQA = {"d_model": 32, "num_layers": 3, "num_dense_layers": 1, "mlp_hidden": 64,
       "num_heads": 4, "num_kv_heads": 2, "qk_norm": "none"}
# MLA with a multi-token prediction module: the three stacks whose attention is clipped
MLA = {**GQA, "attention": "mla", "num_kv_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 8,
       "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "mtp_layers": 1}
BASE = {
    # capacity for every copy, per-sequence balance statistics: any split computes the
    # same forward pass as one device
    "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "capacity_factor": 8.0,
            "balance_scope": "sequence"},
    "train": {"steps": 10, "batch_size": 8, "seq_len": 16},
    # SGD: an update linear in the gradient, so a split's reordered sums stay as small
    # in the parameters as in the gradient
    "optimizer": {"name": "sgd", "warmup_steps": 0, "schedule": "constant",
                  "learning_rate": 0.1, "weight_decay": 0.0, "grad_clip": 0.0},
}


# `rescaled`'s placement of the factors for parameters held whole, in model order
WHOLE = (lambda f: f, lambda name, f: f)


def _cfg(model, threshold, mesh=None, dispatcher="dense", **sections):
    return config_from_dict({**BASE, "model": model, "mesh": mesh or {"data": 1},
                             "moe": {**BASE["moe"], "dispatcher": dispatcher},
                             "optimizer": {**BASE["optimizer"], "qk_clip": threshold},
                             **sections})


def _scores(q, k, scale):
    """float64 [B, H, L, L]: every head's scale q_i . k_j, written out."""
    H, G = q.shape[2], k.shape[2]
    return np.einsum("blhd,bmhd->bhlm", q.astype(np.float64),
                     np.repeat(k, H // G, axis=2).astype(np.float64)) * scale


def test_max_logits_are_the_largest_causal_scores():
    """Tiles of 4 (and one tile, where no tile size divides L) give the written-out
    causal maximum; a planted score above the diagonal (a key after its query) is
    not counted, and a maximum that counted it would differ."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 16, 4, 8)).astype(np.float32)
    k = rng.normal(size=(2, 16, 2, 8)).astype(np.float32)
    q[1, 3, 2] = 10.0  # query 3 of head 2 (group 1) against key 11 of group 1
    k[1, 11, 1] = 10.0
    scores = _scores(q, k, 0.125)
    L = q.shape[1]
    want = np.where(np.tril(np.ones((L, L), bool)), scores, -np.inf).max(axis=(0, 2, 3))
    for block in (4, 16, 5):
        got = max_logits(jnp.asarray(q), jnp.asarray(k), 0.125, block)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert scores.max(axis=(0, 2, 3))[2] > 10 * want[2]


def _logits(module, x, positions):
    """[B, H, L, L]: every head's scores of every pair, from the module's q and k."""
    q, k, v = module.qkv(x, positions)
    H, G = q.shape[2], k.shape[2]
    return np.asarray(jnp.einsum("blhd,bmhd->bhlm", q, jnp.repeat(k, H // G, axis=2))), v


@pytest.mark.parametrize("model", [GQA, {**GQA, "num_kv_heads": 4}, MLA],
                         ids=["grouped", "one_key_per_query", "mla"])
def test_rescales_exactly_the_heads_over_the_threshold(model):
    """A layer whose heads 1 and 2 went over the threshold: after the rescale those
    heads' scores are gamma = tau / S times what they were, for every pair of
    positions (their RoPE parts included), the other heads' are as they were (heads
    sharing a key head with a clipped one too), and the values are untouched."""
    cfg = _cfg({**model, "num_layers": 1, "num_dense_layers": 1, "mtp_layers": 0}, 1.0)
    module = (LatentAttention if model.get("attention") == "mla" else Attention)(
        cfg.model, 0.02, nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 32))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8)) + 100  # RoPE well away from 0
    before, v_before = _logits(module, x, positions)
    max_logit = jnp.asarray([[0.5, 4.0, 2.0, 1.0]])  # tau 1: heads 1 and 2 clipped
    gamma = np.asarray([1.0, 0.25, 0.5, 1.0])
    params = {"dense_layers": {"attn": {k: v[None] for k, v in nnx.state(module).items()}}}
    clipped = qk_clip.rescaled(cfg, params, max_logit, jnp.asarray(True), *WHOLE)
    nnx.update(module, {k: v[0] for k, v in clipped["dense_layers"]["attn"].items()})
    after, v_after = _logits(module, x, positions)
    np.testing.assert_allclose(after, before * gamma[None, :, None, None], rtol=2e-6,
                               atol=2e-6 * np.abs(before).max())
    np.testing.assert_array_equal(v_after, v_before)
    assert np.abs(after[:, 1] - before[:, 1]).max() > 0.5 * np.abs(before[:, 1]).max()
    # a skipped step clips nothing
    kept = qk_clip.rescaled(cfg, params, max_logit, jnp.asarray(False), *WHOLE)
    jax.tree.map(np.testing.assert_array_equal, kept, params)


def _step(cfg):
    """(metrics, parameters before, parameters after) of one step, model order."""
    devices = jax.devices()[:math.prod(getattr(cfg.mesh, a) for a in AXES)]
    steps = build_steps(cfg, make_mesh(cfg.mesh, devices))
    state = steps.init(jax.random.PRNGKey(0))
    before = in_model_order(jax.device_get(state.params).to_pure_dict(), cfg)
    state, metrics = steps.train_step(state, jax.device_put(batch(cfg), steps.batch_sharding))
    return (jax.device_get(metrics), before,
            in_model_order(jax.device_get(state.params).to_pure_dict(), cfg))


def _threshold(model):
    """A threshold between the heads' largest logits at init: some heads over, some
    not, none within float32's reach of it."""
    cfg = _cfg(model, 1e9)
    params = jaxmoe.init(cfg, jax.random.PRNGKey(0))
    _, aux = jax.jit(jaxmoe.apply, static_argnames="config")(params, batch(cfg)[:, :-1], cfg)
    values = np.sort(np.asarray(aux[MAX_LOGIT]).ravel())
    middle = len(values) // 2
    return float(values[middle - 1] + values[middle]) / 2


def test_the_step_clips_after_the_update():
    """One step with QK-clip: the unclipped step's parameters, then each head over the
    threshold rescaled by the forward pass's largest logits; the metrics count the
    heads and give each layer's largest logit. Companion: the two steps differ."""
    tau = _threshold(GQA)
    metrics, before, clipped = _step(_cfg(GQA, tau))
    _, _, unclipped = _step(_cfg(GQA, 1e9))
    cfg = _cfg(GQA, tau)
    _, aux = jaxmoe.apply(before, batch(cfg)[:, :-1], cfg)
    per_head = np.asarray(aux[MAX_LOGIT])
    np.testing.assert_allclose(metrics["max_logit"], per_head.max(axis=1), rtol=1e-6)
    np.testing.assert_array_equal(metrics["qk_clipped"], (per_head > tau).sum(axis=1))
    assert 0 < metrics["qk_clipped"].sum() < per_head.size
    want = qk_clip.rescaled(cfg, unclipped, jnp.asarray(per_head), jnp.asarray(True), *WHOLE)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=0),
                 clipped, want)
    w_q = clipped["dense_layers"]["attn"]["w_q"]
    assert np.abs(w_q - unclipped["dense_layers"]["attn"]["w_q"]).max() > 1e-3


@pytest.fixture(scope="module")
def mla_one_device():
    tau = _threshold({**MLA, "mtp_layers": 0})
    return tau, _step(_cfg(MLA, tau))


MESHES = [({"data": 2, "expert": 4}, "alltoall", {}),  # ZeRO-1 splits the projections
          ({"data": 2, "stage": 2, "expert": 2}, "alltoall",
           {"pipeline": {"stage_microbatches": 2}}),
          ({"data": 2, "context": 2, "expert": 2}, "alltoall", {}),
          # the largest of two micro-batches' maxima
          ({"data": 2, "expert": 2}, "alltoall",
           {"train": {**BASE["train"], "accumulation_steps": 2}})]


def _update_close(got, before, want):
    """Reordered fp32 sums in the gradient (n x 2^-24 relative, n <= 256 terms:
    1.5e-5) and in the largest logits (the same, through a factor tau / S) bound the
    parameters' difference by 1e-4 of the tensor's largest update and of its own size."""
    def close(g, b, w):
        np.testing.assert_allclose(g, w, rtol=1e-4,
                                   atol=1e-4 * float(np.abs(w - b).max() + 1e-30))
    jax.tree.map(close, got, before, want)


@pytest.mark.parametrize("mesh, dispatcher, sections", MESHES,
                         ids=["zero1", "pipeline", "context", "accumulated"])
def test_every_mesh_clips_as_one_device(mla_one_device, mesh, dispatcher, sections):
    tau, (want_metrics, before, want) = mla_one_device
    metrics, got_before, got = _step(_cfg(MLA, tau, mesh, dispatcher, **sections))
    np.testing.assert_allclose(metrics["max_logit"], want_metrics["max_logit"], rtol=1e-5)
    np.testing.assert_array_equal(metrics["qk_clipped"], want_metrics["qk_clipped"])
    _update_close(got, before, want)


def test_a_mesh_without_the_clip_is_caught(mla_one_device):
    """Companion: the same mesh without QK-clip misses the one-device numbers: the
    clip moves the parameters by more than the tolerance, in the dense, MoE and MTP
    layers alike."""
    tau, (want_metrics, before, want) = mla_one_device
    assert all(n > 0 for n in want_metrics["qk_clipped"])  # every layer clips a head
    _, _, got = _step(_cfg(MLA, 1e9, {"data": 2, "expert": 4}, "alltoall"))
    for stack in ("dense_layers", "moe_layers"):
        with pytest.raises(AssertionError):
            _update_close(got[stack]["attn"], before[stack]["attn"], want[stack]["attn"])
    with pytest.raises(AssertionError):
        _update_close(got["mtp_layers"]["block"]["attn"], before["mtp_layers"]["block"]["attn"],
                      want["mtp_layers"]["block"]["attn"])


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="optimizer.qk_clip: model.qk_norm: head"):
        _cfg({**GQA, "qk_norm": "head"}, 100.0)
    with pytest.raises(ConfigError, match="optimizer.qk_clip: must be >= 0"):
        _cfg(GQA, -1.0)
