"""The pure-function API: equal to the module path under jit, grad and vmap; the MoE
layer inside a user's shard_map and a user's own model; parameters from a checkpoint."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxmoe
from jaxmoe.checkpoint import CheckpointError
from jaxmoe.config import MeshConfig
from jaxmoe.data.batches import heldout_batches
from jaxmoe.data.corpus import load_corpus
from jaxmoe.model.transformer import Transformer
from jaxmoe.parallel.layout import GlobalLayout
from jaxmoe.parallel.sharding import make_mesh
from jaxmoe.step import build_steps

CFG = jaxmoe.config_from_dict({
    "model": {"d_model": 32, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
              "num_dense_layers": 1, "mlp_hidden": 64},
    "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "expert_bias": True,
            "capacity_factor": 1.0}})
close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731


@pytest.fixture(scope="module")
def model_and_params():
    key = jax.random.key(0)
    return Transformer.of(CFG, nnx.Rngs(params=key)), jaxmoe.init(CFG, key)


def _tokens(shape, seed=1):
    return jax.random.randint(jax.random.key(seed), shape, 0, 256)


def test_init_is_plain_and_matches_training_init(model_and_params):
    _, params = model_and_params
    assert isinstance(params, dict) and isinstance(params["moe_layers"]["moe"]["router"], dict)
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(params))
    steps = build_steps(CFG, make_mesh(MeshConfig(data=1), jax.devices()[:1]))
    state = steps.init(jax.random.key(0))
    trained_from = nnx.merge_state(state.params, state.buffers).to_pure_dict()
    chex.assert_trees_all_equal(params, trained_from)


def test_apply_equals_module_under_jit_grad_vmap(model_and_params):
    model, params = model_and_params
    graphdef, state = nnx.split(model)
    module = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))  # the module path, compiled
    tokens = _tokens((2, 16))
    ref_logits, ref_aux = module(state, tokens)
    logits, aux = jax.jit(jaxmoe.apply, static_argnums=2)(params, tokens, CFG)
    close(logits, ref_logits)
    jax.tree.map(close, aux, ref_aux)

    def loss(logits, aux):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
        return ce + 0.01 * jnp.mean(aux["balance_loss"])

    ref_grads = jax.jit(jax.grad(lambda s: loss(*nnx.merge(graphdef, s)(tokens))))(state)
    ref_grads = ref_grads.to_pure_dict()
    grads = jax.jit(jax.grad(lambda p: loss(*jaxmoe.apply(p, tokens, CFG))))(params)
    jax.tree.map(close, grads, ref_grads)
    assert float(jnp.abs(grads["moe_layers"]["moe"]["experts"]["w_down"]).sum()) > 0

    # vmap over batches of sequences, and over parameter sets (an ensemble)
    tokens_NxBxL = _tokens((3, 2, 16), seed=2)
    vmapped = jax.vmap(lambda t: jaxmoe.apply(params, t, CFG)[0])(tokens_NxBxL)
    for n in range(3):
        close(vmapped[n], module(state, tokens_NxBxL[n])[0])
    other = jaxmoe.init(CFG, jax.random.key(1))
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, other)
    ensemble = jax.vmap(lambda p: jaxmoe.apply(p, tokens, CFG)[0])(stacked)
    close(ensemble[0], ref_logits)
    close(ensemble[1], jaxmoe.apply(other, tokens, CFG)[0])
    # the comparisons can fail: other parameters give other logits
    assert np.abs(np.asarray(ensemble[1] - ensemble[0])).max() > 1e-2


@pytest.mark.parametrize("change, message", [
    (lambda p, t: (p, t.astype(jnp.float32)), "integer token ids"),
    (lambda p, t: (p, t[0]), "[batch, length]"),
    (lambda p, t: (p, t.at[0, 0].set(256)), "vocab_size=256"),
    (lambda p, t: ({k: v for k, v in p.items() if k != "head"}, t), "params['head']: missing"),
    (lambda p, t: ({**p, "extra": jnp.zeros(3)}, t), "params['extra']: not part"),
    (lambda p, t: ({**p, "embed": p["embed"][:10]}, t), "params['embed']: shape (10, 32)"),
])
def test_bad_input_is_named(model_and_params, change, message):
    params, tokens = change(model_and_params[1], _tokens((2, 8)))
    with pytest.raises(ValueError) as e:
        jaxmoe.apply(params, tokens, CFG)
    assert message in str(e.value)


def test_moe_layer_inside_user_shard_map():
    cfg = jaxmoe.config_from_dict({**CFG.to_dict(), "moe": {**CFG.to_dict()["moe"],
                                                           "dispatcher": "dense"}})
    moe_params = jaxmoe.init_moe_layer(cfg, jax.random.key(3))
    mesh = jax.make_mesh((8,), ("batch",))
    x_BxLxD = jax.random.normal(jax.random.key(4), (16, 4, 32))
    x_sharded = jax.device_put(x_BxLxD, NamedSharding(mesh, P("batch")))
    p_rep = jax.device_put(moe_params, NamedSharding(mesh, P()))

    def per_shard(p, x):
        y, aux = jaxmoe.moe_layer(p, x, cfg)
        return y, jax.lax.psum(aux["counts"], "batch")

    sharded = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("batch")),
                                    out_specs=(P("batch"), P())))
    y, counts_E = sharded(p_rep, x_sharded)
    assert len(y.sharding.device_set) == 8 and y.addressable_shards[0].data.shape == (2, 4, 32)
    ref_y, ref_aux = jaxmoe.moe_layer(moe_params, x_BxLxD, cfg)
    close(y, ref_y)
    np.testing.assert_array_equal(counts_E, ref_aux["counts"])
    with jax.set_mesh(mesh):  # an Explicit mesh (make_mesh's default) wants it for grad
        grads = jax.grad(lambda p: jnp.sum(sharded(p, x_sharded)[0] ** 2))(p_rep)
    ref_grads = jax.grad(lambda p: jnp.sum(jaxmoe.moe_layer(p, x_BxLxD, cfg)[0] ** 2))(moe_params)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-6)
    other = jaxmoe.init_moe_layer(cfg, jax.random.key(5))
    other = jax.device_put(other, NamedSharding(mesh, P()))
    assert np.abs(np.asarray(sharded(other, x_sharded)[0]) - np.asarray(y)).max() > 1e-3


def test_moe_layer_in_a_user_model_trains():
    """A model of the user's own: embedding, one jaxmoe MoE feed-forward, head."""
    k_embed, k_moe, k_head = jax.random.split(jax.random.key(6), 3)
    params = {"embed": 0.02 * jax.random.normal(k_embed, (256, 32)),
              "moe": jaxmoe.init_moe_layer(CFG, k_moe),
              "head": 0.02 * jax.random.normal(k_head, (32, 256))}

    def loss_fn(params, tokens_BxL):
        x = params["embed"][tokens_BxL[:, :-1]]
        y, aux = jaxmoe.moe_layer(params["moe"], x, CFG)
        logits = (x + y) @ params["head"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BxL[:, 1:]).mean()
        return ce + 0.01 * aux["balance_loss"]

    tx = optax.adam(3e-2)

    @jax.jit
    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    tokens = _tokens((4, 17), seed=7)
    opt_state = tx.init(params)
    params, opt_state, first, grads = train_step(params, opt_state, tokens)
    assert float(jnp.abs(grads["moe"]["experts"]["w_gate_up"]).sum()) > 0
    assert float(jnp.abs(grads["moe"]["router"]["w"]).sum()) > 0
    for _ in range(10):
        params, opt_state, loss, _ = train_step(params, opt_state, tokens)
    assert float(loss) < float(first) - 0.5


def test_load_params_from_training_checkpoint(tiny_run):
    params, cfg = jaxmoe.load_params(tiny_run)
    # dropless by default; the run's own dispatcher and capacity one argument away
    assert cfg.moe.dispatcher == "grouped" and cfg.moe.capacity_factor == 4 / 2
    assert cfg.train.steps == 4
    _, trained = jaxmoe.load_params(tiny_run, dropless=False)
    assert trained.moe.dispatcher == "dense" and trained.moe.capacity_factor == 1.25
    # the job's final held-out loss, recomputed from the loaded parameters
    corpus = load_corpus("stdlib", None, 256, cfg.train.seq_len)
    batches = heldout_batches(corpus.heldout, cfg.train.batch_size, cfg.train.seq_len,
                              cfg.train.eval_batches)
    ces = [optax.softmax_cross_entropy_with_integer_labels(
        jaxmoe.apply(params, b[:, :-1], cfg)[0], b[:, 1:]).mean() for b in batches]
    records = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    final_eval = [r["eval_ce"] for r in records if "eval_ce" in r][-1]
    np.testing.assert_allclose(float(np.mean(ces)), final_eval, rtol=1e-5)
    fresh = jaxmoe.init(cfg, jax.random.key(cfg.train.seed))
    assert np.abs(params["embed"] - np.asarray(fresh["embed"])).max() > 1e-4  # it trained
    # a step directory works too, and one MoE layer's parameters drop into moe_layer
    step_params, _ = jaxmoe.load_params(tiny_run / "checkpoints" / "4")
    chex.assert_trees_all_equal(step_params, params)
    y, _ = jaxmoe.moe_layer(jaxmoe.moe_layer_params(params, cfg, 1), jnp.ones((1, 3, 32)), cfg)
    assert y.shape == (1, 3, 32)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        jaxmoe.load_params(tiny_run / "nowhere")


def test_local_config_is_dropless_unless_asked(model_and_params):
    """CFG's `grouped` at capacity 1.0 drops copies; the local config holds them all,
    as the dense reference computes, and keeps the training capacity on request."""
    _, params = model_and_params
    tokens = _tokens((4, 24))
    dense, _ = jaxmoe.apply(params, tokens, jaxmoe.config_from_dict(
        CFG.to_dict(), ["moe.dispatcher=dense"]))
    local = jaxmoe.api.local_config(CFG)
    assert local.moe.dispatcher == "grouped" and local.moe.capacity_factor == 4 / 2
    y, aux = jaxmoe.apply(params, tokens, local)
    assert int(aux["dropped"].sum()) == 0
    close(y, dense)
    trained = jaxmoe.api.local_config(CFG, dropless=False)
    assert trained.moe.capacity_factor == 1.0
    y_trained, aux = jaxmoe.apply(params, tokens, trained)
    assert int(aux["dropped"].sum()) > 0 and np.abs(y_trained - dense).max() > 1e-3


def test_top_level_names():
    from jaxmoe.hf import load_hf
    assert jaxmoe.load_hf is load_hf
    assert jaxmoe.hf.load_hf is load_hf and jaxmoe.plan.__doc__  # submodules on first use
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        jaxmoe.nonesuch


def test_load_params_from_a_padded_circular_pipeline(tmp_path):
    """Pipeline stages hold the MoE layers as [V, S, per], padded to equal chunks:
    load_params must hand back [Lm] in model order without the padding."""
    from jaxmoe import checkpoint
    from jaxmoe.config import config_from_dict
    cfg = config_from_dict({
        "model": {"d_model": 32, "num_layers": 7, "num_heads": 4, "num_kv_heads": 2,
                  "num_dense_layers": 1, "mlp_hidden": 64},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "dispatcher": "dense",
                "expert_bias": True},
        "mesh": {"data": 4, "stage": 2},
        "pipeline": {"stage_microbatches": 2, "virtual_stages": 2},
        "train": {"steps": 4, "batch_size": 8, "seq_len": 16, "run_dir": str(tmp_path)},
        "optimizer": {"warmup_steps": 1}})
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    assert cfg.num_moe_layers == 6 and steps.program.stack.slots == 8  # teeth: 2 pads
    state = steps.init(jax.random.PRNGKey(5))
    manager = checkpoint.checkpoint_manager(tmp_path, cfg)
    checkpoint.save(manager, state, {"step": 0}, steps)
    manager.wait_until_finished()
    tokens = jax.random.randint(jax.random.key(6), (8, 16), 0, 256)
    ref, _ = jax.jit(lambda s, t: nnx.merge(steps.graphdef, s.params, s.buffers)(
        t, layout=GlobalLayout(steps.mesh, cfg)))(state, jax.device_put(tokens, steps.batch_sharding))
    params, local = jaxmoe.load_params(tmp_path)
    assert jax.tree.leaves(params["moe_layers"])[0].shape[0] == 6
    got, _ = jaxmoe.apply(params, tokens, local)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)
    # the same model-order params on the pipeline's mesh: held and run by stage
    staged, _ = jaxmoe.apply(params, tokens, cfg, mesh=steps.mesh)
    np.testing.assert_allclose(np.asarray(staged), np.asarray(ref), rtol=2e-5, atol=2e-5)
