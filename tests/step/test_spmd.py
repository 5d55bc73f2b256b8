"""SPMD on 8 fake CPU devices: sharded steps equal the single-device step, the
shardings are real, and no host transfer happens inside a steady-state step."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.checkpoint import abstract_target
from jaxmoe.config import ConfigError, MeshConfig, config_from_dict, override_config
from jaxmoe.eval import heldout
from jaxmoe.parallel.sharding import fraction_per_device, make_mesh, per_device_shapes
from jaxmoe.plan.collectives import compiled_collective_bytes, compiled_collectives, totals
from jaxmoe.step import build_steps

from model_order import in_model_order, same_init

BASE = {
    "model": {"d_model": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "num_dense_layers": 1, "mlp_hidden": 64},
    # global balance scope: the loss must not depend on how the batch is split
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "capacity_factor": 4.0,
            "shared_expert_hidden": 16, "balance_scope": "global"},
    "train": {"steps": 10, "batch_size": 16, "seq_len": 16, "accumulation_steps": 2},
    # no clip: the first step's first moment is then exactly (1 - b1) x the gradient
    "optimizer": {"warmup_steps": 0, "learning_rate": 1e-2, "grad_clip": 0.0},
}
LR, B1, STEPS = 1e-2, 0.9, 2


def _cfg(mesh=None, accumulation=2, dtype="float32", pipeline=None, **moe):
    # every micro-batch splits over 8 devices
    train = {**BASE["train"], "accumulation_steps": accumulation,
             "batch_size": max(16, 8 * accumulation)}
    model = {**BASE["model"], "compute_dtype": dtype}
    if pipeline is not None:
        # 4 MoE layers, for 2 stages (x 2 virtual stages); per-sequence balance
        # statistics, so the loss does not depend on how a pipeline cuts the batch
        model["num_layers"] = 5
        moe = {"balance_scope": "sequence", **moe}
    return config_from_dict({**BASE, "moe": {**BASE["moe"], **moe}, "mesh": mesh or {"data": 1},
                             "train": train, "model": model, "pipeline": pipeline or {}})


def _batches(n=STEPS, rows=16):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (rows, 17), dtype=np.int32) for _ in range(n)]


def _run(cfg, devices, params=None):
    """Two steps: (initial params, first step's gradients, final state, losses, grad norms).
    params: initial parameters to start from instead of the seed's."""
    steps = build_steps(cfg, make_mesh(cfg.mesh, devices))
    state = steps.init(jax.random.PRNGKey(0))
    if params is not None:
        state = state._replace(params=jax.device_put(params, steps.state_shardings.params))
    initial = jax.device_get(state.params)
    losses, norms, first_grads = [], [], None
    for b in _batches(rows=cfg.train.batch_size):
        state, metrics = steps.train_step(state, jax.device_put(b, steps.batch_sharding))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
        if first_grads is None:  # m_1 = (1 - b1) g_1: the gradient the step reduced
            first_grads = jax.tree.map(lambda m: m / (1 - B1), jax.device_get(state.opt_state.mu))
    return initial, first_grads, state, losses, norms


@pytest.fixture(scope="module")
def reference():
    """One device's run for a micro-batch count (the balance loss is per micro-batch,
    so the count changes the gradient)."""
    runs = {}

    def get(accumulation):
        if accumulation not in runs:
            initial, grads, state, losses, norms = _run(_cfg(accumulation=accumulation,
                                                             dispatcher="dense"),
                                                        jax.devices()[:1])
            runs[accumulation] = initial, grads, jax.device_get(state.params), losses, norms
        return runs[accumulation]

    return get


def _grads_close(got, want):
    """Reordered fp32 sums over the batch's 256 tokens: ~256 x 2^-24 of the terms'
    magnitude, which a tensor's largest gradient bounds; a missing or doubled
    reduction is off by a factor of 2 or more."""
    def close(a, b):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))
    jax.tree.map(close, got, want)


def _first_step_matches(got, want):
    """Loss, norm and gradients of the first step (before Adam has turned last-bit
    gradient differences into lr-sized parameter differences); the gradient check
    has teeth: half or twice the reduction fails it."""
    (grads, losses, norms), (want_grads, want_losses, want_norms) = got, want
    np.testing.assert_allclose(losses[0], want_losses[0], rtol=1e-5)
    np.testing.assert_allclose(norms[0], want_norms[0], rtol=1e-5)
    _grads_close(grads, want_grads)
    for wrong in (0.5, 2.0):
        with pytest.raises(AssertionError):
            _grads_close(jax.tree.map(lambda g: wrong * g, grads), want_grads)


@pytest.mark.parametrize("mesh, dispatcher, accumulation", [
    ({"data": 2, "expert": 4, "parallelism": "ddp"}, "alltoall", 2),
    ({"data": 2, "expert": 4, "parallelism": "ddp"}, "alltoall", 1),
    ({"data": 2, "expert": 4, "parallelism": "ddp", "zero1": False}, "alltoall", 2),
    ({"data": 2, "expert": 4, "parallelism": "fsdp"}, "alltoall", 2),
    ({"data": 1, "expert": 8, "parallelism": "ddp"}, "allgather", 2),
    ({"data": 8, "parallelism": "ddp"}, "grouped", 2),
    ({"data": 8, "parallelism": "ddp", "zero1": False}, "grouped", 4),
])
def test_sharded_step_equals_single_device(reference, mesh, dispatcher, accumulation):
    ref_initial, ref_grads, ref_params, ref_losses, ref_norms = reference(accumulation)
    initial, grads, state, losses, norms = _run(
        _cfg(mesh, accumulation, dispatcher=dispatcher), jax.devices())
    chex.assert_trees_all_equal(initial, ref_initial)
    _first_step_matches((grads, losses, norms), (ref_grads, ref_losses, ref_norms))
    # Adam moves a weight by about lr per step whatever its gradient's size, so a
    # near-zero gradient whose last bits differ can move it by up to 2 lr the
    # other way: parameters can differ by 2 lr per step, and no more.
    params = jax.device_get(state.params)
    chex.assert_trees_all_close(params, ref_params, rtol=0, atol=2 * LR * STEPS)


PIPE = {"data": 2, "stage": 2, "expert": 2}
GPIPE = {"stage_microbatches": 2}
CIRCULAR = {"stage_microbatches": 2, "virtual_stages": 2}


def _pipeline_and_reference(pipeline, accumulation, dispatcher, dtype="float32", zero1=True,
                            loss_chunk=0, remat="none", overrides=(), schedule="circular"):
    """The ddp step with pipeline stages on (data 2, stage 2, expert 2), and one
    device running the same model (from the same initial weights, in model order)
    without stages, chunked loss or remat; first-step gradients in model order.
    overrides: config keys both take."""
    cfg = override_config(_cfg({**PIPE, "zero1": zero1}, accumulation, dtype, pipeline,
                               dispatcher=dispatcher),
                          [f"train.loss_chunk={loss_chunk}", f"train.remat={remat}",
                           f"pipeline.schedule={schedule}", *overrides])
    initial, grads, _, losses, norms = _run(cfg, jax.devices())
    one = override_config(_cfg(None, accumulation, dtype, pipeline={}, dispatcher="dense"),
                          list(overrides))
    one_initial, want, _, want_losses, want_norms = _run(one, jax.devices()[:1])
    # the same seed gives the same model whatever holds it
    same_init(in_model_order(initial, cfg), one_initial)
    return cfg, (in_model_order(grads, cfg), losses, norms), (want, want_losses, want_norms)


@pytest.mark.parametrize("pipeline, accumulation, dispatcher, zero1, loss_chunk, remat", [
    (GPIPE, 1, "alltoall", True, 0, "full"),
    (CIRCULAR, 4, "ragged", False, 8, "none"),
])
def test_ddp_pipeline_step_equals_single_device(pipeline, accumulation, dispatcher, zero1,
                                                loss_chunk, remat):
    """Stages run per device, the activations shifted by a ppermute: the gradients
    (in model order) and the norm are one device's (whose loss is not chunked nor
    recomputed)."""
    cfg, got, want = _pipeline_and_reference(pipeline, accumulation, dispatcher, zero1=zero1,
                                             loss_chunk=loss_chunk, remat=remat)
    _first_step_matches(got, want)


@pytest.mark.parametrize("pipeline, accumulation, dispatcher, overrides", [
    (GPIPE, 2, "alltoall", []),
    # interleaved, every router statistic the step reads: QK-clip's logits (the dense
    # layer's from the first chunk), the router biases' counts
    (CIRCULAR, 2, "ragged", ["moe.expert_bias=true", "optimizer.qk_clip=50",
                             "model.qk_norm=none"]),
])
def test_ddp_1f1b_step_equals_single_device(pipeline, accumulation, dispatcher, overrides):
    """`pipeline.schedule: 1f1b` runs both slices' micro-batches in one pass, the
    embedding and dense layer in the first chunk, the head and loss in the last: the
    first gradients, losses and norms are one device's, and so are the router
    biases after the step (from the loads the loop totals)."""
    cfg, got, want = _pipeline_and_reference(pipeline, accumulation, dispatcher, remat="full",
                                             schedule="1f1b", overrides=overrides)
    _first_step_matches(got, want)


def _temp_bytes(cfg) -> int:
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32,
                                 sharding=steps.batch_sharding)
    compiled = steps.train_step.lower(abstract_target(steps), batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_a_1f1b_step_holds_the_warmup_count_not_the_micro_batches():
    """From 2 to 8 micro-batches of one row per data x expert device (circular, 2
    virtual stages, inputs recomputed), the circular step keeps each micro-batch's
    chunk inputs for both rounds: its temporary memory grows by at least 6 x 2 layer
    inputs (132 here). The 1F1B step holds the warm-up count's inputs whatever the
    count, and grows by less than 4 (1.2 here: the rows, and the router statistics of
    the loop's 12 more iterations)."""
    activation = 64 * 32 * 4  # one row of 64 positions of width 32 in fp32

    def grown(schedule):
        sizes = [_temp_bytes(override_config(
            _cfg(PIPE, 1, pipeline=CIRCULAR, dispatcher="alltoall"),
            [f"pipeline.stage_microbatches={M}", f"train.batch_size={4 * M}",
             "train.seq_len=64", "train.remat=full", f"pipeline.schedule={schedule}"]))
            for M in (2, 8)]
        return sizes[1] - sizes[0]

    circular, one_f_one_b = grown("circular"), grown("1f1b")
    assert circular >= 6 * 2 * activation, circular
    assert one_f_one_b < 4 * activation, one_f_one_b


MX_PROJECTIONS = ["model.projection_precision=mxfp8", "model.num_kv_heads=4",
                  "moe.shared_expert_hidden=32"]  # every projection a multiple of 32 wide


def _mx_close(got, want):
    """fp32 reorderings (another device count, the dispatcher's sums) move a rare value
    across an e4m3 rounding boundary, and the entries it reaches off the reordered sums'
    bound (`_grads_close`): such an element moves by one e4m3 step, 2^-3 of itself at
    most, within the tensor's largest gradient. In a weight matrix the entries it
    reaches are rare: at most 1% (1 in 1,024 and 1 in 8,192 here). A norm's scale is
    not: each of its entries sums over every token, so a value flipped in any token
    reaches all of them (2 of 32 off, at 1.4e-4 of the largest, in the pipeline's dense
    layer under XLA:CPU's unoptimised code), and only the size is bounded there. Half
    or twice the reduction moves every entry."""
    def close(path, a, b):
        err, top = np.abs(a - b), float(np.abs(b).max())
        off = err > 1e-4 * np.abs(b) + 1e-4 * top
        if "scale" not in jax.tree_util.keystr(path):
            assert off.mean() <= 0.01, f"{off.mean():.1%} of the entries are off"
        assert (err[off] <= 2.0 ** -3 * top).all(), f"{err.max() / top:.2g} of the largest"
    jax.tree_util.tree_map_with_path(close, got, want)
    for wrong in (0.5, 2.0):
        with pytest.raises(AssertionError):
            jax.tree_util.tree_map_with_path(lambda p, g, w: close(p, wrong * g, w), got, want)


@pytest.mark.parametrize("pipeline", [None, GPIPE])
def test_mxfp8_projections_ddp_step_equals_single_device(pipeline):
    """MXFP8 projections (each weight quantised once per step, whole, before its ZeRO-1
    shards meet; in a pipeline, per round): the ddp step's first gradients are one
    device's. Companion: they are not the bf16 projections' gradients."""
    if pipeline is None:
        one = override_config(_cfg(None, 2, dispatcher="dense"), MX_PROJECTIONS)
        _, want, _, want_losses, _ = _run(one, jax.devices()[:1])
        _, got, _, losses, _ = _run(override_config(
            _cfg({"data": 2, "expert": 4}, 2, dispatcher="alltoall"), MX_PROJECTIONS),
            jax.devices())
    else:
        _, (got, losses, _), (want, want_losses, _) = _pipeline_and_reference(
            pipeline, 2, "alltoall", overrides=MX_PROJECTIONS)
    np.testing.assert_allclose(losses[0], want_losses[0], rtol=1e-5)
    _mx_close(got, want)
    bf16_projections = override_config(_cfg(None, 2, dispatcher="dense", pipeline=pipeline and {}),
                                       MX_PROJECTIONS[1:])
    _, other, _, _, _ = _run(bf16_projections, jax.devices()[:1])
    with pytest.raises(AssertionError):
        _mx_close(got if pipeline is None else want, other)


@pytest.mark.parametrize("mesh, pipeline, dispatcher", [
    ({"data": 2, "expert": 4}, None, "alltoall"),
    (PIPE, CIRCULAR, "ragged"),
])
def test_ddp_eval_equals_single_device(mesh, pipeline, dispatcher):
    """Held-out loss and each row's scores (eval_step at the training capacity,
    score_step dropless) through the per-device program (expert-parallel, and a
    circular pipeline whose last stage alone holds the output) are one device's:
    fp32 sums of up to 256 tokens reordered (2^-16 relative bounds them); a share
    counted on every stage would be 2x, rows out of order another row's. A wide init
    (not the ~uniform ln 256 of the default) makes rows and batches differ by far more."""
    wide = ["model.init_std=0.3"]
    cfg = override_config(_cfg(mesh, 1, pipeline=pipeline, dispatcher=dispatcher), wide)
    one = override_config(_cfg(None, 1, pipeline=None if pipeline is None else {},
                               dispatcher="dense"), wide)
    assert cfg.mesh.parallelism == "ddp" and cfg.num_moe_layers == one.num_moe_layers
    batches = _batches(2)
    mask = np.random.default_rng(1).random(batches[0][:, 1:].shape) < 0.5  # some targets
    evals, rows = [], []
    for c, devices in [(cfg, jax.devices()), (one, jax.devices()[:1])]:
        steps = build_steps(c, make_mesh(c.mesh, devices))
        state = steps.init(jax.random.PRNGKey(0))
        evals.append([heldout.nats(steps, state, [b]) / b[:, 1:].size for b in batches])
        put = lambda a: jax.device_put(a, steps.batch_sharding)  # noqa: E731
        rows.append([jax.device_get(step(state.params, state.buffers, put(batches[0]), put(mask)))
                     for step in (steps.eval_step, steps.score_step)])
    np.testing.assert_allclose(evals[0], evals[1], rtol=2.0 ** -16)
    assert abs(evals[1][0] - evals[1][1]) > 2.0 ** -8 * evals[1][0]
    for got, want in zip(*rows):
        np.testing.assert_allclose(got["logprob"], want["logprob"], rtol=2.0 ** -16)
        np.testing.assert_array_equal(got["greedy"], want["greedy"])
        logprob = want["logprob"]
        assert np.abs(logprob - np.roll(logprob, 1)).min() > 2.0 ** -8 * np.abs(logprob).max()


@pytest.mark.parametrize("mesh, dispatcher", [
    ({"data": 2, "expert": 4, "parallelism": "ddp"}, "ragged"),
    ({"data": 8, "parallelism": "ddp", "zero1": False}, "grouped"),
    (PIPE, "alltoall"),  # with GPipe stages
])
def test_bf16_ddp_step_equals_single_device(mesh, dispatcher):
    """bf16 compute: the per-device step (ZeRO-1 shards of fp32 masters, gathered
    as bf16) against one device computing in bf16."""
    if mesh is PIPE:
        _, (got, losses, norms), (want, want_losses, want_norms) = _pipeline_and_reference(
            GPIPE, 4, dispatcher, dtype="bfloat16")
    else:
        _, want, _, want_losses, want_norms = _run(
            _cfg(None, 4, dtype="bfloat16", dispatcher="dense"), jax.devices()[:1])
        _, got, _, losses, norms = _run(_cfg(mesh, 4, dtype="bfloat16", dispatcher=dispatcher),
                                        jax.devices())
    _bf16_close(got, want)
    np.testing.assert_allclose(losses[0], want_losses[0], rtol=U_BF16)
    np.testing.assert_allclose(norms[0], want_norms[0], rtol=8 * U_BF16)


U_BF16 = 2.0 ** -8


def _bf16_close(got, want):
    """bf16 rounds to 2^-8 relative; two orders of the same bf16 sums differ by a few of
    those units of a tensor's largest terms (8 allowed: 3%), a factor 2 by 100%: half or
    twice the gradient fails."""
    def close(g, w, scale=1.0):
        np.testing.assert_allclose(scale * g, w, rtol=8 * U_BF16,
                                   atol=8 * U_BF16 * float(np.abs(w).max()))

    jax.tree.map(close, got, want)
    for wrong in (0.5, 2.0):
        with pytest.raises(AssertionError):
            jax.tree.map(lambda g, w: close(g, w, wrong), got, want)


def _step_collectives(cfg):
    """Every collective of `cfg`'s train step, compiled for abstract inputs."""
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    batch = jax.ShapeDtypeStruct((cfg.train.batch_size, 17), jnp.int32,
                                 sharding=steps.batch_sharding)
    return compiled_collectives(steps.train_step.lower(abstract_target(steps), batch).compile())


def _compiled_step(mesh, accumulation, dispatcher="alltoall", pipeline=None, stage_rows=None):
    """Per kind, the step's collectives but those that hand a slice's rows between
    pipeline stages (`StageRowsLayout`, scope `stage_rows`: activations, once per
    slice), which go to `stage_rows` (a list) when given."""
    cfg = _cfg(mesh, accumulation, dispatcher=dispatcher, pipeline=pipeline,
               balance_scope="microbatch")
    ops = _step_collectives(cfg)
    if stage_rows is not None:
        stage_rows += [c for c in ops if "stage_rows" in c.op_name]
    return totals([c for c in ops if "stage_rows" not in c.op_name])


def test_ddp_reduces_gradients_once_per_step():
    """No gradient reduction inside the layer scan or the micro-batch loop, and as
    many per step with 8 micro-batches as with 2; routing reads only the device's
    own tokens (no all-gather inside the loops). The auto-sharded fsdp step is
    the contrast: it reduces inside the loops, more often with more micro-batches."""
    ddp = {M: _compiled_step({"data": 2, "expert": 4, "parallelism": "ddp"}, M) for M in (2, 8)}
    for t in ddp.values():
        for kind in ("all-reduce", "reduce-scatter", "all-gather"):
            assert t[kind].ops_in_loops == 0, (kind, t[kind])
        assert t["all-to-all"].ops_in_loops > 0  # the expert exchange, once per layer
    for kind in ("all-reduce", "reduce-scatter"):
        assert ddp[2][kind].runs == ddp[8][kind].runs and ddp[2][kind].bytes == ddp[8][kind].bytes
    # one reduce-scatter per ZeRO-1-split parameter, the bytes of one fp32 gradient
    # copy x (n-1)/n over its replicas
    assert ddp[2]["reduce-scatter"].runs > 0
    fsdp = {M: _compiled_step({"data": 2, "expert": 4, "parallelism": "fsdp"}, M) for M in (2, 8)}
    in_loops = lambda t: t["all-reduce"].ops_in_loops + t["reduce-scatter"].ops_in_loops  # noqa: E731
    assert in_loops(fsdp[2]) > 0
    runs = lambda t: t["all-reduce"].runs + t["reduce-scatter"].runs  # noqa: E731
    assert runs(fsdp[8]) > runs(fsdp[2])


def test_ddp_pipeline_reduces_gradients_once_per_step():
    """With stages the activations move between them by collective-permute inside
    the pipeline loop, and still no gradient is reduced there. A slice's rows go
    into the pipeline and out of it by an all-gather and a reduce-scatter over
    `stage` in the accumulation loop: activations of that slice, the stages sharing
    the work outside the pipeline."""
    stage_rows = {A: [] for A in (2, 8)}
    ddp = {A: _compiled_step({**PIPE, "parallelism": "ddp"}, A, pipeline=CIRCULAR,
                             stage_rows=stage_rows[A]) for A in (2, 8)}
    for ops in stage_rows.values():  # gather in and scatter out, and their transposes
        assert {c.kind for c in ops} == {"all-gather", "reduce-scatter"}
        assert all(c.in_loop and c.group_size == PIPE["stage"] for c in ops)
    for t in ddp.values():
        for kind in ("all-reduce", "reduce-scatter", "all-gather"):
            assert t[kind].ops_in_loops == 0, (kind, t[kind])
        assert t["collective-permute"].ops_in_loops > 0  # the stage shift
    for kind in ("all-reduce", "reduce-scatter"):
        assert ddp[2][kind].runs == ddp[8][kind].runs and ddp[2][kind].bytes == ddp[8][kind].bytes


def test_ddp_1f1b_reduces_gradients_once_per_step():
    """The 1F1B pass sums every micro-batch's gradients on its device, the first and
    last chunks' (embedding, dense layer, head) too: no gradient reduction inside its
    loop, and as many per step with 8 slices as with 2; activations and cotangents
    move between stages by collective-permute inside it."""
    def compiled(A):
        cfg = override_config(_cfg({**PIPE, "parallelism": "ddp"}, A, dispatcher="alltoall",
                                   pipeline=CIRCULAR, balance_scope="microbatch"),
                              ["train.remat=full", "pipeline.schedule=1f1b"])
        return totals(_step_collectives(cfg))

    ddp = {A: compiled(A) for A in (2, 8)}
    for t in ddp.values():
        for kind in ("all-reduce", "reduce-scatter", "all-gather"):
            assert t[kind].ops_in_loops == 0, (kind, t[kind])
        assert t["collective-permute"].ops_in_loops >= 2  # both ways
    for kind in ("all-reduce", "reduce-scatter"):
        assert ddp[2][kind].runs == ddp[8][kind].runs and ddp[2][kind].bytes == ddp[8][kind].bytes
        assert ddp[2][kind].runs > 0


def test_zero1_shards_gathered_in_the_pipeline_equal_gathered_first(monkeypatch):
    """bf16 masters in ZeRO-1 shards on a circular pipeline (data 2 x stage 2 x expert
    2, 2 virtual stages, one slice, reduced in bf16): the stage stack reaches the
    pipeline as its shards, gathered a round at a time in the pipeline's loop and its
    gradient reduce-scattered there (`ddp.Sharded`). Against the same step gathering
    everything first and reducing after: the first gradients agree up to the order of
    bf16 additions (a few units of 2^-8 of a tensor's largest terms; 8 allowed, as
    above), and the programs differ as they should: all-gathers and
    reduce-scatters inside loops in the one, none in the other."""
    import jaxmoe.step.program

    cfg = override_config(_cfg({**PIPE, "zero1": True}, 1, "bfloat16", CIRCULAR,
                               dispatcher="alltoall"), ["train.grad_reduce_dtype=bfloat16"])

    def first_grads_and_loops():
        t = totals(_step_collectives(cfg))
        return _run(cfg, jax.devices())[1], t["all-gather"].ops_in_loops, \
            t["reduce-scatter"].ops_in_loops

    got, gathers, scatters = first_grads_and_loops()
    assert gathers > 0 and scatters > 0
    monkeypatch.setattr(jaxmoe.step.program.DeviceProgram, "_defers", lambda self, path, r: False)
    want, gathers, scatters = first_grads_and_loops()
    assert gathers == scatters == 0
    _bf16_close(got, want)


@pytest.mark.parametrize("remat", ["full", "none"])
def test_zero1_shards_gathered_in_the_layer_scan_equal_gathered_first(monkeypatch, remat):
    """bf16 masters in ZeRO-1 shards without stages (data 2 x expert 4, one slice,
    reduced in bf16): the MoE stack reaches the layer scan as its shards, each layer's
    gathered an iteration ahead and its gradient reduce-scattered in the backward
    loop. Against the same step gathering everything first and reducing after: the
    first gradients agree up to the order of bf16 additions (8 units allowed, as
    above; half or twice fails), the losses alike, and every gradient is still
    reduced once: the reduce-scatters move the same bytes per step, inside the loop
    in the one and after it in the other. Under full recomputation the backward
    pass does not gather the weights again: the gathers move the same bytes."""
    import jaxmoe.step.program

    cfg = override_config(_cfg({"data": 2, "expert": 4, "zero1": True}, 1, "bfloat16",
                               dispatcher="alltoall"),
                          ["train.grad_reduce_dtype=bfloat16", f"train.remat={remat}",
                           "model.num_layers=4"])  # 3 MoE layers: a loop of 2

    def run():
        _, grads, _, losses, _ = _run(cfg, jax.devices())
        return grads, losses, totals(_step_collectives(cfg))

    got, losses, t = run()
    assert t["all-gather"].ops_in_loops > 0 and t["reduce-scatter"].ops_in_loops > 0
    monkeypatch.setattr(jaxmoe.step.program.DeviceProgram, "_defers", lambda self, path, r: False)
    want, want_losses, first = run()
    assert first["all-gather"].ops_in_loops == first["reduce-scatter"].ops_in_loops == 0
    _bf16_close(got, want)
    np.testing.assert_allclose(losses, want_losses, rtol=U_BF16)
    for kind in ("reduce-scatter", "all-gather"):
        assert t[kind].bytes == first[kind].bytes, kind


@pytest.mark.parametrize("dim", [1, 2])
def test_sharded_parts_join_to_the_gathered_tensor(dim):
    """A ZeRO-1 shard gathered in 4 parts along its last axis and joined is the tensor
    gathered whole, whether the shard splits the last axis (the parts then interleave
    every device's slices) or another; a part joined in the wrong place is caught."""
    from jax.sharding import PartitionSpec as P

    from jaxmoe.parallel import ddp
    mesh = make_mesh(MeshConfig(data=8))
    plan = ddp.Reduction(("data",), (), ("data",), dim, 1)
    x = jnp.arange(2 * 16 * 32, dtype=jnp.float32).reshape(2, 16, 32)

    def local(shard, order):
        t = ddp.Sharded(shard, plan)
        parts = jnp.stack([t.gathered_part(p, 4) for p in range(4)])[order]
        return t.joined(parts), t.gathered()

    spec = P(*[None] * dim, "data")
    for order, same in ((jnp.arange(4), True), (jnp.array([1, 0, 2, 3]), False)):
        joined, whole = jax.jit(jax.shard_map(
            local, mesh=mesh, in_specs=(spec, P()), out_specs=(P(), P()),
            check_vma=False))(x, order)
        np.testing.assert_array_equal(whole, x)
        assert np.array_equal(joined, x) == same


def _leaf(state, *path):
    node = state
    for p in path:
        node = node[p]
    return node[...] if hasattr(node, "get_metadata") else node


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_shardings_are_real(mode):
    cfg = _cfg({"data": 2, "expert": 4, "parallelism": mode}, dispatcher="alltoall")
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    state = steps.init(jax.random.PRNGKey(0))
    p = state.params
    w_up = _leaf(p, "moe_layers", "moe", "experts", "w_gate_up")  # [layers, E, D, 2F]
    wq = _leaf(p, "moe_layers", "attn", "w_q")  # [layers, D, H, Hd]
    L, E, D, F2 = w_up.shape
    if mode == "ddp":
        assert per_device_shapes(w_up) == {(L, E // 4, D, F2)}  # experts resident, E/ep each
        assert per_device_shapes(wq) == {wq.shape}  # dense weights replicated
    else:
        assert per_device_shapes(w_up) == {(L, E // 4, D // 2, F2)}
        assert per_device_shapes(wq) == {(L, D // 2) + wq.shape[2:]}  # split over data
    # ZeRO-1: Adam moments are split over the tensor's replica axes
    mu = state.opt_state.mu
    mu_wq = _leaf(mu, "moe_layers", "attn", "w_q")
    mu_up = _leaf(mu, "moe_layers", "moe", "experts", "w_gate_up")
    assert fraction_per_device(mu_wq) == pytest.approx(1 / 8)  # replicated over data x expert
    assert fraction_per_device(mu_up) == pytest.approx(1 / 8)  # experts over expert, + data
    # collectives the compiled step moves: expert-parallel exchange present
    batch = jax.ShapeDtypeStruct((16, 17), jnp.int32, sharding=steps.batch_sharding)
    moved = compiled_collective_bytes(steps.train_step.lower(state, batch).compile())
    assert moved["all-to-all"] > 0 and moved["all-reduce"] > 0


def test_no_host_transfer_in_steady_state():
    cfg = _cfg({"data": 2, "expert": 4}, dispatcher="alltoall", expert_bias=True)
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    state = steps.init(jax.random.PRNGKey(0))
    batches = [jax.device_put(b, steps.batch_sharding) for b in _batches(3)]
    state, _ = steps.train_step(state, batches[0])  # compile outside the guard
    with jax.transfer_guard("disallow"):
        for b in batches[1:]:
            state, metrics = steps.train_step(state, b)
    assert np.isfinite(float(metrics["loss"]))
    with pytest.raises(Exception, match="[Dd]isallowed"):  # the guard does bite
        with jax.transfer_guard("disallow"):
            steps.train_step(state, _batches(1)[0])


@pytest.mark.parametrize("mesh, moe, train, key", [
    ({"data": 3}, {}, {}, "mesh"),
    ({"data": 1, "expert": 16}, {"num_experts": 16}, {}, "mesh"),
    ({"data": 2, "expert": 4}, {"num_experts": 6}, {}, "moe.num_experts"),
    ({"data": 8}, {}, {"batch_size": 12, "accumulation_steps": 1}, "train.batch_size"),
    ({"data": 2, "expert": 4, "parallelism": "tp"}, {}, {}, "mesh.parallelism"),
])
def test_bad_parallel_config(mesh, moe, train, key):
    with pytest.raises(ConfigError, match=f"^{key}"):
        cfg = config_from_dict({**BASE, "mesh": mesh, "moe": {**BASE["moe"], **moe},
                                "train": {**BASE["train"], **train}})
        build_steps(cfg, make_mesh(cfg.mesh))


def test_mesh_minus_one_fills():
    mesh = make_mesh(MeshConfig(data=-1, expert=4))
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "context": 1, "expert": 4}
    mesh = make_mesh(MeshConfig(data=2, context=-1))
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "context": 4, "expert": 1}


def test_bf16_compute_keeps_sharded_fp32_master(reference):
    ref_losses = reference(2)[3]
    cfg = config_from_dict({**BASE, "model": {**BASE["model"], "compute_dtype": "bfloat16"},
                            "moe": {**BASE["moe"], "dispatcher": "alltoall"},
                            "mesh": {"data": 2, "expert": 4}})
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    state = steps.init(jax.random.PRNGKey(0))
    wq = state.params["moe_layers"]["attn"]["w_q"][...]
    assert wq.dtype == jnp.float32 and fraction_per_device(wq) == pytest.approx(1 / 8)
    losses = []
    for b in _batches(rows=cfg.train.batch_size):
        state, metrics = steps.train_step(state, jax.device_put(b, steps.batch_sharding))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)  # bf16 tracks fp32
    assert losses != ref_losses  # but is not the fp32 computation


def test_accumulated_step_equals_one_whole_batch_step():
    """Two micro-batches of 8 give the whole batch's mean gradient (with the router
    losses off, since those are not linear in the batch)."""
    def params_after(accumulation, batch):
        cfg = config_from_dict({**BASE, "moe": {**BASE["moe"], "dispatcher": "dense",
                                                "balance_loss_weight": 0.0, "z_loss_weight": 0.0},
                                "train": {**BASE["train"], "accumulation_steps": accumulation}})
        steps = build_steps(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
        state, metrics = steps.train_step(steps.init(jax.random.PRNGKey(0)), batch)
        return jax.device_get(state.params), float(metrics["loss"]), float(metrics["grad_norm"])

    first, second = _batches(2)
    p1, loss1, norm1 = params_after(1, first)
    p2, loss2, norm2 = params_after(2, first)
    assert loss2 == pytest.approx(loss1, rel=1e-6)
    # Adam's step hardly depends on the gradient's scale; its norm does (a sum of
    # the micro-batches' gradients instead of their mean would double it)
    assert norm2 == pytest.approx(norm1, rel=1e-4)
    # Adam's first step moves each weight by about lr = 1e-2 whatever its gradient's
    # size, so near-zero gradients may round differently: 1% of a step
    chex.assert_trees_all_close(p1, p2, rtol=0, atol=1e-4)
    # a different batch moves the parameters elsewhere, by far more than that tolerance
    p3, _, _ = params_after(2, second)
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p3)))
    assert gap > 5e-3
