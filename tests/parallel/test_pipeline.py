"""Pipeline stages equal the sequential model: loss, gradients and router stats."""

import contextlib
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from jaxmoe.checkpoint import abstract_target
from jaxmoe.config import ConfigError, config_from_dict
from jaxmoe.model.transformer import Transformer
from jaxmoe.parallel.layout import layout_for
from jaxmoe.parallel.pipeline import StageStack, bubble_fraction
from jaxmoe.parallel.sharding import make_mesh, per_device_shapes
from jaxmoe.plan.program_flops import program_flops
from jaxmoe.step import build_steps

from model_order import in_model_order, same_init

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


def _model(mesh_cfg, pipeline_microbatches=1, dispatcher="dense", devices=None):
    """(loss(params, remat) -> (loss, aux), initial state) of BASE on this mesh."""
    cfg = config_from_dict({**BASE, "mesh": mesh_cfg,
                            "pipeline": {"stage_microbatches": pipeline_microbatches},
                            "moe": {**BASE["moe"], "dispatcher": dispatcher}})
    n = mesh_cfg.get("data", 1) * mesh_cfg.get("stage", 1) * mesh_cfg.get("expert", 1)
    mesh = make_mesh(cfg.mesh, devices or jax.devices()[:n])
    steps = build_steps(cfg, mesh)
    state = steps.init(jax.random.PRNGKey(0))
    tokens = jax.device_put(TOKENS, steps.batch_sharding)

    def loss(params, remat="none"):
        logits, aux = nnx.merge(steps.graphdef, params, state.buffers)(
            tokens[:, :-1], layout=layout_for(cfg, mesh), remat=remat)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return ce + 0.01 * jnp.mean(aux["balance_loss"]) + 0.001 * jnp.mean(aux["z_loss"]), aux

    return loss, state, cfg


def _grads(loss, state, remat="none"):
    (value, aux), grads = jax.jit(jax.value_and_grad(
        functools.partial(loss, remat=remat), has_aux=True))(state.params)
    return float(value), jax.device_get(aux), jax.device_get(grads)


def _loss_and_grads(mesh_cfg, pipeline_microbatches=1, dispatcher="dense", devices=None):
    """(loss, aux, gradients in model order, state)."""
    loss, state, cfg = _model(mesh_cfg, pipeline_microbatches, dispatcher, devices)
    value, aux, grads = _grads(loss, state)
    return value, aux, in_model_order(grads, cfg), state


@pytest.fixture(scope="module")
def sequential():
    return _loss_and_grads({"data": 1}, devices=jax.devices()[:1])


@pytest.mark.parametrize("mesh, micro, dispatcher", [
    ({"data": 4, "stage": 2}, 4, "dense"),
    ({"data": 2, "stage": 4}, 4, "grouped"),
    ({"data": 1, "stage": 4}, 8, "grouped"),
    ({"data": 2, "stage": 2, "expert": 2}, 2, "alltoall"),
    ({"data": 2, "stage": 2, "expert": 2}, 2, "ragged"),  # vmap of ragged_all_to_all
])
def test_pipeline_equals_sequential(sequential, mesh, micro, dispatcher):
    ref_loss, ref_aux, ref_grads, _ = sequential
    loss, aux, grads, state = _loss_and_grads(mesh, micro, dispatcher)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)  # noqa: E731
    jax.tree.map(close, grads, ref_grads)
    # every MoE layer's router statistics reach the output, bubbles masked out
    np.testing.assert_array_equal(aux["counts"], ref_aux["counts"])
    np.testing.assert_allclose(aux["balance_loss"], ref_aux["balance_loss"], rtol=1e-5)
    assert aux["counts"].sum() == 4 * 16 * 16 * 2  # 4 MoE layers x tokens x top-2
    # and the gradient check has teeth: the gradients are far from zero
    embed = grads["embed"][...]
    assert np.abs(embed).max() > 1e-4
    # the stage dimension is really split: each device holds only its stages' layers
    S = mesh["stage"]
    w = state.params["moe_layers"]["moe"]["experts"]["w_gate_up"][...]
    E_local = 8 // mesh.get("expert", 1)
    assert w.shape[:3] == (1, S, 4 // S)  # [V, S, per]
    assert per_device_shapes(w) == {(1, 1, 4 // S, E_local) + w.shape[4:]}
    dense = state.params["dense_layers"]["attn"]["w_q"][...]
    assert per_device_shapes(dense) == {dense.shape}  # dense prefix layer is replicated


def _scan_residuals(loss, params, remat):
    """Shapes the pipeline's loop saves for the backward pass."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(functools.partial(loss, remat=remat), params)
    return re.findall(r"^\w+\[([\d,]*)\] output of scan from .*pipeline\.py", out.getvalue(), re.M)


def test_pipeline_remat_equals_no_remat_and_keeps_only_the_buffers():
    S, M, B, L, D = 2, 4, 16, 16, 32
    loss, state, _ = _model({"data": 4, "stage": 2}, M, "grouped")
    value, aux, grads = _grads(loss, state, "none")
    remat_value, remat_aux, remat_grads = _grads(loss, state, "full")
    # the same ops recomputed; XLA's fusions may only reorder fp32 sums of a few hundred terms
    assert remat_value == pytest.approx(value, rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max())), remat_grads, grads)
    np.testing.assert_array_equal(remat_aux["counts"], aux["counts"])
    # and the programs differ as they should: with remat each of the M + S - 1 iterations
    # keeps only its stages' layer inputs (per = 2 layers each; not the micro-batch
    # store it carries, nor the weights it sliced) and a few indices and keys,
    # without it every intermediate of its layers
    kept = _scan_residuals(loss, state.params, "full")
    T, per = M + S - 1, 4 // S
    assert [k for k in kept if np.prod([int(n) for n in k.split(",")]) > 8 * T] == \
        [f"{T},{S},{per},{B // M},{L},{D}"]
    assert len(_scan_residuals(loss, state.params, "none")) > 10


def test_pipeline_offload_equals_no_remat():
    """`offload` inside a pipeline stage's checkpoint (which keeps the layer inputs:
    `keeping_layer_inputs`, a policy that answers with more than save-or-not) traces
    and gives the loss and gradients of no remat; the same tolerance as above."""
    loss, state, _ = _model({"data": 4, "stage": 2}, 4, "grouped")
    value, _, grads = _grads(loss, state, "none")
    offload_value, _, offload_grads = _grads(loss, state, "offload")
    assert offload_value == pytest.approx(value, rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max())), offload_grads, grads)

    # and the stage's policy does offload: its backward pass moves tensors to the host
    # and back (device_put), where a policy that ignored the layer's would move none
    def moves(remat):
        grad = jax.grad(lambda p: loss(p, remat=remat)[0])
        return str(jax.make_jaxpr(grad)(state.params)).count("device_put")
    assert moves("offload") > 0 and moves("full") == 0


def test_pipeline_recomputes_each_layer_once():
    """The ddp step's stage checkpoint keeps its layers' inputs, so the backward pass
    runs each MoE layer's forward once more: the expert GEMMs and attention of the
    pipelined layers are recomputed exactly as often as they run forward (the dense
    layer before the pipeline too). Recomputing the stage and then each layer in it
    again made it 2x for the expert GEMMs."""
    cfg = config_from_dict({**BASE, "mesh": {"data": 2, "stage": 2, "expert": 2},
                            "pipeline": {"stage_microbatches": 2},
                            "train": {**BASE["train"], "remat": "full"},
                            "moe": {**BASE["moe"], "dispatcher": "alltoall"}})
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    batch = jax.ShapeDtypeStruct(TOKENS.shape, jnp.int32, sharding=steps.batch_sharding)
    program = steps.train_step.lower(abstract_target(steps), batch).compile().as_text()
    flops = program_flops(program).by_scope
    for scope in ("expert_gemms", "attention"):
        assert flops[scope]["forward"] > 0
        assert flops[scope]["recompute"] == flops[scope]["forward"], scope


def test_pipeline_train_step_matches_and_zero1_applies(sequential):
    cfg = config_from_dict({**BASE, "mesh": {"data": 2, "stage": 2, "expert": 2},
                            "pipeline": {"stage_microbatches": 2},
                            "moe": {**BASE["moe"], "dispatcher": "alltoall"}})
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    state = steps.init(jax.random.PRNGKey(0))
    state, metrics = steps.train_step(state, jax.device_put(TOKENS, steps.batch_sharding))
    assert metrics["load_max_over_mean"].shape == (4,)
    assert float(metrics["loss"]) == pytest.approx(sequential[0], rel=1e-5)
    mu = state.opt_state.mu["moe_layers"]["attn"]["w_q"][...]
    # split over stage by the layer axis, and over data x expert by ZeRO-1
    assert np.prod(next(iter(per_device_shapes(mu)))) * 8 == mu.size


def test_pipeline_config_errors():
    with pytest.raises(ConfigError, match="^mesh.stage: 4 MoE layers cannot fill 8"):
        config_from_dict({**BASE, "mesh": {"data": 1, "stage": 8}})
    # 4 MoE layers on 3 stages: padded to 3 chunks of 2, whatever says the stage count
    open_stage = config_from_dict({**BASE, "mesh": {"data": 2, "stage": -1}})
    steps = build_steps(open_stage, make_mesh(open_stage.mesh, jax.devices()[:6]))
    assert steps.program.stack == StageStack(1, 3, 2)
    # -1 resolved to 8 stages: refused when the mesh is known, before compiling
    with pytest.raises(ConfigError, match="^mesh.stage: 4 MoE layers cannot fill 8 stages"):
        build_steps(config_from_dict({**BASE, "mesh": {"data": 1, "stage": -1}}),
                    make_mesh(config_from_dict({**BASE, "mesh": {"data": 1, "stage": -1}}).mesh))
    with pytest.raises(ConfigError, match="^pipeline.stage_microbatches"):
        config_from_dict({**BASE, "pipeline": {"stage_microbatches": 3}})


def test_circular_init_holds_no_more_than_one_round():
    """Init draws each stage's chunks on that stage: with two virtual stages its
    scratch memory is the one-round pipeline's, where drawing the stack in model
    order and then reshaping it into [V, S, per] would move every layer across
    stages through a whole gathered copy."""
    temps = {}
    for V in (1, 2):
        cfg = config_from_dict({**BASE, "model": {**BASE["model"], "num_layers": 9},
                                "mesh": {"data": 4, "stage": 2},
                                "pipeline": {"stage_microbatches": 2, "virtual_stages": V}})
        steps = build_steps(cfg, make_mesh(cfg.mesh))
        key = jax.random.PRNGKey(0)
        temps[V] = steps.init.lower(key).compile().memory_analysis().temp_size_in_bytes

    def reshaped(key):  # the model-order draw, laid out afterwards
        _, params, _ = nnx.split(Transformer.of(cfg, nnx.Rngs(params=key)), nnx.Param, ...)
        return steps.program.stored(params)

    by_reshape = jax.jit(reshaped, out_shardings=steps.state_shardings.params).lower(
        key).compile().memory_analysis().temp_size_in_bytes
    assert temps[2] <= temps[1] * 1.05
    assert by_reshape > 2 * temps[2]


def test_stage_stack_flattens_to_model_order():
    """[V, S, per]: chunk v S + s on stage s holds model layers (v S + s) per + j."""
    stack = StageStack.of(7, 2, 2)  # 7 layers in 2 x 2 chunks of 2: one pad
    assert stack == StageStack(2, 2, 2) and stack.slots == 8
    a = jnp.arange(7)
    held = np.asarray(stack.stored(a))
    np.testing.assert_array_equal(held[1, 0], [4, 5])  # round 1 of stage 0: chunk 2
    np.testing.assert_array_equal(held[0, 1], [2, 3])  # round 0 of stage 1: chunk 1
    assert held[1, 1, 1] == 0 and not np.asarray(stack.real(7))[1, 1, 1]  # the pad
    np.testing.assert_array_equal(stack.model(stack.stored(a), 7), a)


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)


@pytest.mark.parametrize("stages, virtual, dispatcher, expert, moe_layers, precision", [
    (2, 2, "dense", 1, 8, "compute"), (4, 2, "grouped", 1, 8, "compute"),
    (2, 2, "alltoall", 2, 8, "compute"),
    (4, 1, "grouped", 1, 7, "compute"), (2, 2, "alltoall", 2, 6, "mxfp8")])  # 7, 6: padded
def test_stage_held_stacks_equal_sequential(stages, virtual, dispatcher, expert, moe_layers,
                                            precision):
    """Each layout's init is the sequential model's (same seed, model order), each
    stage holds its own chunks only, and loss, gradients and router stats match."""
    raw = {**BASE, "model": {**BASE["model"], "num_layers": moe_layers + 1},
           "moe": {**BASE["moe"], "dispatcher": dispatcher, "expert_precision": precision},
           "mesh": {"data": 8 // stages // expert, "stage": stages, "expert": expert},
           "pipeline": {"stage_microbatches": 4, "virtual_stages": virtual}}
    cfg = config_from_dict(raw)
    mesh = make_mesh(cfg.mesh)
    steps = build_steps(cfg, mesh)
    stack = steps.program.stack
    assert stack.slots == 8 and (stack.virtual, stack.stages) == (virtual, stages)
    state = steps.init(jax.random.PRNGKey(0))
    tokens = jax.device_put(TOKENS, steps.batch_sharding)
    w = state.params["moe_layers"]["moe"]["experts"]["w_gate_up"][...]
    assert w.shape[:4] == (virtual, stages, 8 // (stages * virtual), 8)
    assert per_device_shapes(w) == {(virtual, 1) + w.shape[2:3] + (8 // expert,) + w.shape[4:]}

    def loss(graphdef, params, buffers, mesh, cfg):
        logits, aux = nnx.merge(graphdef, params, buffers)(tokens[:, :-1],
                                                           layout=layout_for(cfg, mesh))
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return ce + 0.01 * jnp.mean(aux["balance_loss"]), aux

    grad = lambda g, m, c: jax.jit(jax.value_and_grad(  # noqa: E731
        lambda p, b: loss(g, p, b, m, c), has_aux=True))
    (value, aux), grads = grad(steps.graphdef, mesh, cfg)(state.params, state.buffers)
    # the sequential model from the same seed: the same weights, in model order
    seq_cfg = config_from_dict({**raw, "mesh": {"data": 1}, "pipeline": {},
                                "moe": {**raw["moe"], "dispatcher": "dense"}})
    seq = build_steps(seq_cfg, make_mesh(seq_cfg.mesh, jax.devices()[:1]))
    seq_state = seq.init(jax.random.PRNGKey(0))
    same_init(in_model_order(jax.device_get((state.params, state.buffers)), cfg),
              jax.device_get((seq_state.params, seq_state.buffers)))
    (ref_value, ref_aux), ref_grads = grad(seq.graphdef, None, seq_cfg)(seq_state.params,
                                                                        seq_state.buffers)
    assert float(value) == pytest.approx(float(ref_value), rel=1e-5)
    got = jax.device_get(grads)
    pads = ~np.asarray(stack.real(moe_layers))
    jax.tree.map(lambda a: np.testing.assert_array_equal(a[pads], 0), got["moe_layers"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6),
                 in_model_order(got, cfg), jax.device_get(ref_grads))
    np.testing.assert_array_equal(aux["counts"], ref_aux["counts"])  # model layer order
    assert aux["counts"].shape[0] == moe_layers


def test_expert_bias_update_lands_on_its_stage_chunk():
    """Counts come in model order; a circular, padded stack holds layers by stage."""
    from jaxmoe.model.router import update_expert_bias
    stack = StageStack.of(7, 2, 2)  # 7 real layers + 1 pad
    counts_LxE = np.zeros((7, 4), np.int32)
    counts_LxE[4, 0] = 8  # model layer 4 overloads expert 0
    buffers = {"router": {"bias": jnp.zeros((2, 2, 2, 4))}}
    new = np.array(update_expert_bias(buffers, counts_LxE, 0.1, stack.stored)["router"]["bias"])
    # model layer 4 is chunk 2's first layer: round 1 of stage 0
    assert new[1, 0, 0, 0] < 0 and (new[1, 0, 0, 1:] > 0).all()
    new[1, 0, 0] = 0
    np.testing.assert_array_equal(new, 0)  # balanced layers and the pad stay put


def test_each_stage_device_holds_its_own_chunks_of_an_update():
    """Inside the ddp step a per-layer update reaches each device as its stage's
    chunks (circular and padded here)."""
    from jax.sharding import PartitionSpec as P

    from jaxmoe.step.build import abstract_model
    from jaxmoe.step.program import DeviceProgram
    cfg = config_from_dict({**BASE, "model": {**BASE["model"], "num_layers": 8},
                            "mesh": {"data": 2, "stage": 2, "expert": 2},
                            "moe": {**BASE["moe"], "dispatcher": "alltoall"},
                            "pipeline": {"stage_microbatches": 2, "virtual_stages": 2}})
    mesh = make_mesh(cfg.mesh)
    program = DeviceProgram(cfg, mesh, abstract_model(cfg)[1])
    layers = jnp.arange(7, dtype=jnp.float32) + 1  # model layer m + 1; pads 0
    held = jax.jit(jax.shard_map(lambda: program.own_layers(layers), mesh=mesh, in_specs=(),
                                 out_specs=P(None, "stage")))()
    np.testing.assert_array_equal(held, [[[1, 2], [3, 4]], [[5, 6], [7, 0]]])


def test_bubble_with_virtual_stages():
    assert bubble_fraction(4, 4, 2) == pytest.approx(3 / 11)
