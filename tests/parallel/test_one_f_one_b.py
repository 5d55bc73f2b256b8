"""Interleaved 1F1B in lockstep: the schedule keeps the lockstep rules and holds
Megatron's warm-up count whatever the micro-batch count, and one SPMD pass over 4
fake devices gives the sequential model's loss and gradients, with compiled memory
that does not grow with the micro-batches as GPipe-class schedules' does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxmoe.ops.vma import vary, varying_axes
from jaxmoe.parallel import lockstep
from jaxmoe.parallel.one_f_one_b import device_pass

S, W, PER, ROWS, WIDTH = 4, 2, 2, 16, 32


@pytest.mark.parametrize("stages, virtual, micro", [(2, 1, 4), (4, 1, 8), (4, 2, 8), (2, 4, 8),
                                                    (4, 2, 12), (8, 2, 16)])
def test_the_schedule_holds_the_warmup_count_at_circular_s_cost(stages, virtual, micro):
    sch = lockstep.schedule(stages, virtual, micro)
    assert sch.held == lockstep.warmup_held(stages, virtual)
    # each stage skipping what it does not run, a pass costs what one of the circular
    # schedule's does: W M + S - 1 forward iterations and as many backward
    assert sch.cost(backward=2.0) == (virtual * micro + stages - 1) * 3
    # four times the micro-batches, the same held
    assert lockstep.schedule(stages, virtual, 4 * micro).held == sch.held


def test_the_anchor_rows_hold_megatron_s_warmup_count():
    # (S - 1) 2 + (W - 1) S + 1: Large, Ultra, DeepSeek-V3 on B300 and on GB300
    assert [lockstep.warmup_held(S_, W_) for S_, W_ in ((4, 2), (8, 4), (8, 2), (2, 8))] == \
        [11, 39, 23, 17]
    assert lockstep.schedule(8, 2, 32).held == 23


def test_the_check_catches_a_broken_schedule():
    sch = lockstep.schedule(4, 2, 8)
    early = dict(sch.backward)
    early[(0, 3)] = sch.backward[(0, 4)]  # before chunk 4's cotangent reaches chunk 3
    with pytest.raises(AssertionError, match="before its cotangent"):
        lockstep.check(sch._replace(backward=early))
    soon = dict(sch.forward)
    soon[(0, 1)] = sch.forward[(0, 0)]  # in the iteration its input is sent
    with pytest.raises(AssertionError, match="before its input"):
        lockstep.check(sch._replace(forward=soon))
    twice = dict(sch.forward)
    twice[(1, 0)] = sch.forward[(0, 0)]  # two forwards on stage 0 at once
    with pytest.raises(AssertionError, match="two ops of one kind"):
        lockstep.check(sch._replace(forward=twice))
    with pytest.raises(AssertionError, match="held miscounted"):
        lockstep.check(sch._replace(held=sch.held - 1))
    with pytest.raises(lockstep.Deadlock):
        lockstep.schedule(4, 2, 8, cap=2)  # round 1 waits on inputs round 0 never frees
    with pytest.raises(ValueError, match="multiple of 4 micro-batches, not 6"):
        lockstep.schedule(4, 2, 6)


def chunk(w_PxDxD, x_bxD, m, v):
    """`per` residual tanh layers, and a router-loss-like part of the chunk's own."""
    def layer(carry, w):
        x, part = carry
        h = jnp.tanh(x @ w)
        return (x + h, part + 0.1 * jnp.mean(h ** 2)), None
    part = vary(jnp.zeros((), x_bxD.dtype), varying_axes(x_bxD))
    (y, part), _ = lax.scan(layer, (x_bxD, part), w_PxDxD)
    return y, part, {"part": part}


def last_loss(head_D, y_bxD, m):
    loss = jnp.mean((y_bxD * head_D) ** 2) / 2
    return loss, {"loss": loss}


def sequential(w_WxSxPxDxD, outer, parts: bool = True):
    total = 0.0
    for m in range(outer["x"].shape[0]):
        x = outer["x"][m]
        for c in range(W * S):
            x, part, _ = chunk(w_WxSxPxDxD[c // S, c % S], x, m, c // S)
            total = total + (part if parts else 0.0)
        total = total + last_loss(outer["head"], x, m)[0]
    return total


def one_pass(tables, mesh, outer_inputs: bool = True):
    """The pass over 4 stages; the inputs are differentiated (`outer`, read by `first`)
    or constants."""

    def device(w_Wx1xPxDxD, outer):
        def first(o, m):
            return (o["x"] if outer_inputs else outer["x"])[m], {"first": jnp.float32(m)}

        loss, grads, grads_outer, stats = device_pass(
            tables, first, chunk, lambda o, y, m: last_loss(o["head"], y, m),
            w_Wx1xPxDxD[:, 0], outer if outer_inputs else {"head": outer["head"]})
        totals = jax.tree.map(lambda a: lax.psum(jnp.sum(a, axis=0), "stage"), stats)
        return (lax.psum(loss, "stage"), grads[:, None], lax.psum(grads_outer, "stage"),
                totals)

    return jax.jit(jax.shard_map(device, mesh=mesh, in_specs=(P(None, "stage"), P()),
                                 out_specs=(P(), P(None, "stage"), P(), P()), check_vma=True))


def circular(mesh, micro: int):
    """The circular schedule as autodiff runs it (`pipeline.device_pipeline`'s order),
    each chunk recomputed from its input: it keeps every micro-batch's inputs."""
    step = jax.checkpoint(lambda w, x: chunk(w, x, 0, 0)[0],
                          policy=jax.checkpoint_policies.nothing_saveable)

    def device(w_Wx1xPxDxD, x_MxbxD):
        s = lax.axis_index("stage")

        def iteration(carry, t):
            inbox, store = carry
            arrived = t - S
            filed = jnp.where((s == 0) & (arrived >= 0), inbox, store[arrived % micro])
            store = lax.dynamic_update_index_in_dim(store, filed, arrived % micro, 0)
            x = jnp.where(s == 0, store[t % micro], inbox)
            copy = t - s
            out = step(w_Wx1xPxDxD[jnp.clip(copy // micro, 0, W - 1), 0], x)
            kept = jnp.where((s == S - 1) & (copy >= 0) & (copy < W * micro), out,
                             store[copy % micro])
            store = lax.dynamic_update_index_in_dim(store, kept, copy % micro, 0)
            return (lax.ppermute(out, "stage", [(i, (i + 1) % S) for i in range(S)]), store), None

        init = jax.tree.map(lambda a: lax.pcast(a, ("stage",), to="varying"),
                            (jnp.zeros_like(x_MxbxD[0]), x_MxbxD))
        (_, store), _ = lax.scan(iteration, init, jnp.arange(W * micro + S - 1))
        loss = jnp.sum(jax.vmap(lambda y: last_loss(1.0, y, 0)[0])(store))
        return lax.psum(jnp.where(s == S - 1, loss, 0.0), "stage")

    run = jax.shard_map(device, mesh=mesh, in_specs=(P(None, "stage"), P()), out_specs=P(),
                        check_vma=True)
    return jax.jit(jax.grad(run, argnums=(0, 1)))


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:S]), ("stage",))


def _inputs(micro: int):
    key_w, key_x, key_h = jax.random.split(jax.random.PRNGKey(0), 3)
    w = jax.random.normal(key_w, (W, S, PER, WIDTH, WIDTH)) / np.sqrt(WIDTH)
    return w, {"x": jax.random.normal(key_x, (micro, ROWS, WIDTH)),
               "head": 1 + jax.random.uniform(key_h, (WIDTH,))}


def test_a_pass_gives_the_sequential_model_s_loss_and_gradients(mesh):
    """In float64, so that the only differences are the order of sums: a few hundred
    roundings of 2^-53 each, far inside 1e-12 of each tensor's largest entry, where a
    wrong plumbing moves entries by their own size."""
    micro = 8
    with jax.enable_x64(True):
        w, outer = jax.tree.map(lambda a: a.astype(jnp.float64), _inputs(micro))
        tables = lockstep.tables(lockstep.schedule(S, W, micro))
        loss, grads, grads_outer, stats = one_pass(tables, mesh)(w, outer)
        ref_loss, (ref_w, ref_outer) = jax.value_and_grad(sequential, argnums=(0, 1))(w, outer)
        assert grads.dtype == grads_outer["x"].dtype == jnp.float64

        def close(got, ref) -> bool:
            return bool(jnp.all(jnp.abs(got - ref) <= 1e-12 * jnp.max(jnp.abs(ref))))

        assert close(loss, ref_loss) and close(grads, ref_w)
        assert close(grads_outer["x"], ref_outer["x"])
        assert close(grads_outer["head"], ref_outer["head"])
        # each backward's stats once: the micro-batch numbers from the first chunks, the
        # parts and losses summing to the loss
        first, parts, losses = stats
        assert float(first["first"]) == sum(range(micro))
        assert close(parts["part"] + losses["loss"], ref_loss)
        # companions: the chunks' own parts are in the gradient, and a table that files
        # one micro-batch's input gradient under another is caught
        assert not close(jax.grad(sequential)(w, outer, parts=False), ref_w)
        b_micro = tables.b_micro.copy()
        first_op = tuple(np.argwhere(tables.b_first == 1)[0])
        b_micro[first_op] = (b_micro[first_op] + 1) % micro
        _, _, wrong, _ = one_pass(tables._replace(b_micro=b_micro), mesh)(w, outer)
        assert not close(wrong["x"], ref_outer["x"])


def _temp_bytes(fn, *args) -> int:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_a_pass_s_memory_does_not_grow_with_the_micro_batches(mesh):
    """A stage holds the warm-up count's chunk inputs whatever M; the circular schedule
    holds M W. From M = 8 to 24 (the inputs arguments, not differentiated) the pass's
    temporary memory grows by at most 4 inputs' worth; the circular one's by at least
    the 32 more chunk inputs it keeps."""
    input_bytes = ROWS * WIDTH * 4
    grown = {}
    for name in ("1f1b", "circular"):
        sizes = []
        for micro in (8, 24):
            w, outer = _inputs(micro)
            fn = (one_pass(lockstep.tables(lockstep.schedule(S, W, micro)), mesh,
                           outer_inputs=False) if name == "1f1b" else circular(mesh, micro))
            sizes.append(_temp_bytes(fn, w, outer if name == "1f1b" else outer["x"]))
        grown[name] = sizes[1] - sizes[0]
    assert grown["1f1b"] <= 4 * input_bytes, grown
    assert grown["circular"] >= 16 * W * input_bytes, grown


def test_the_pass_s_conditionals_name_the_tables_they_follow(mesh):
    """Every conditional of the compiled pass names its table (`branch_scope`), so the
    planner's walk prices each iteration by the branches its stages take: below its
    price at every conditional's slowest branch, which would run the first, a middle
    and the last chunk's work in every iteration."""
    from jaxmoe.parallel.one_f_one_b import branches
    from jaxmoe.plan.hlo import Program, branch_table
    from jaxmoe.plan.roofline import Link, roofline

    tables = lockstep.tables(lockstep.schedule(S, W, 8))
    program = Program(one_pass(tables, mesh).lower(*_inputs(8)).compile().as_text())
    named = [branch_table(i) for insts in program.computations.values() for i in insts
             if i.op == "conditional"]
    assert named and set(named) <= set(branches(tables)), named
    link = Link(bf16_flops=1e11, fp8_flops=2e11, hbm=1e9, scale_up=1e9, scale_out=1e8)
    lockstep_s = roofline(program, link, branches=branches(tables)).step_s
    assert 0 < lockstep_s < 0.9 * roofline(program, link).step_s
