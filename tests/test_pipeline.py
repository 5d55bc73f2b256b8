"""Pipeline stages equal the sequential model: loss, gradients and router stats."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxmoe.config import ConfigError, config_from_dict
from jaxmoe.parallel.pipeline import bubble_fraction
from jaxmoe.sharding import make_mesh, per_device_shapes
from jaxmoe.step import build_steps

BASE = {
    "model": {"d_model": 32, "num_layers": 5, "num_heads": 4, "num_kv_heads": 2,
              "num_dense_layers": 1, "mlp_hidden": 64},
    # sequence scope and no drops: the loss does not depend on how the batch is cut
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "capacity_factor": 8.0,
            "balance_scope": "sequence", "dispatcher": "dense", "shared_expert_hidden": 16},
    "train": {"steps": 10, "batch_size": 16, "seq_len": 16},
    "optimizer": {"warmup_steps": 0},
}
TOKENS = np.random.default_rng(0).integers(0, 256, (16, 17)).astype(np.int32)


def _loss_and_grads(mesh_cfg, pipeline_microbatches=1, dispatcher="dense", devices=None):
    cfg = config_from_dict({**BASE, "mesh": mesh_cfg,
                            "pipeline": {"microbatches": pipeline_microbatches},
                            "moe": {**BASE["moe"], "dispatcher": dispatcher}})
    n = mesh_cfg.get("data", 1) * mesh_cfg.get("stage", 1) * mesh_cfg.get("expert", 1)
    mesh = make_mesh(cfg.mesh, devices or jax.devices()[:n])
    steps = build_steps(cfg, mesh)
    state = steps.init(jax.random.PRNGKey(0))
    tokens = jax.device_put(TOKENS, steps.batch_sharding)

    def loss(params):
        logits, aux = nnx.merge(steps.graphdef, params, state.buffers)(tokens[:, :-1], mesh=mesh)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return ce + 0.01 * jnp.mean(aux["balance_loss"]) + 0.001 * jnp.mean(aux["z_loss"]), aux

    (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state.params)
    return float(value), jax.device_get(aux), jax.device_get(grads), state


@pytest.fixture(scope="module")
def sequential():
    return _loss_and_grads({"data": 1}, devices=jax.devices()[:1])


@pytest.mark.parametrize("mesh, micro, dispatcher", [
    ({"data": 4, "stage": 2}, 4, "dense"),
    ({"data": 2, "stage": 4}, 4, "grouped"),
    ({"data": 1, "stage": 4}, 8, "grouped"),
    ({"data": 2, "stage": 2, "expert": 2}, 2, "alltoall"),
])
def test_pipeline_equals_sequential(sequential, mesh, micro, dispatcher):
    ref_loss, ref_aux, ref_grads, _ = sequential
    loss, aux, grads, state = _loss_and_grads(mesh, micro, dispatcher)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)  # noqa: E731
    jax.tree.map(close, grads, ref_grads)
    # every MoE layer's router statistics reach the output, bubbles masked out
    np.testing.assert_array_equal(aux["counts_E"], ref_aux["counts_E"])
    np.testing.assert_allclose(aux["balance_loss"], ref_aux["balance_loss"], rtol=1e-5)
    assert aux["counts_E"].sum() == 4 * 16 * 16 * 2  # 4 MoE layers x tokens x top-2
    # and the gradient check has teeth: another batch gives other gradients
    embed = grads["embed"][...]
    assert np.abs(embed).max() > 1e-4
    # the stage dimension is really split: each device holds only its stages' layers
    S = mesh["stage"]
    w = state.params["moe_layers"]["moe"]["experts"]["w_gate_up"][...]
    E_local = 8 // mesh.get("expert", 1)
    assert per_device_shapes(w) == {(4 // S, E_local) + w.shape[2:]}
    dense = state.params["dense_layers"]["attn"]["w_q"][...]
    assert per_device_shapes(dense) == {dense.shape}  # dense prefix layer is replicated


def test_pipeline_train_step_matches_and_zero1_applies(sequential):
    cfg = config_from_dict({**BASE, "mesh": {"data": 2, "stage": 2, "expert": 2},
                            "pipeline": {"microbatches": 2},
                            "moe": {**BASE["moe"], "dispatcher": "alltoall"}})
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    state = steps.init(jax.random.PRNGKey(0))
    state, metrics = steps.train_step(state, jax.device_put(TOKENS, steps.batch_sharding))
    assert metrics["load_max_over_mean"].shape == (4,)
    assert float(metrics["loss"]) == pytest.approx(sequential[0], rel=1e-5)
    mu = state.opt_state[1][0].mu["moe_layers"]["attn"]["w_q"][...]
    # split over stage by the layer axis, and over data x expert by ZeRO-1
    assert np.prod(next(iter(per_device_shapes(mu)))) * 8 == mu.size


def test_pipeline_config_errors():
    with pytest.raises(ConfigError, match="^mesh.stage"):
        config_from_dict({**BASE, "mesh": {"data": 1, "stage": 3}})
    with pytest.raises(ConfigError, match="^pipeline.microbatches"):
        config_from_dict({**BASE, "pipeline": {"microbatches": 3}})


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
