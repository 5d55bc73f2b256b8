"""Expert-parallel dispatchers against the single-device references, on 8 fake devices."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmoe.checkpoint import abstract_target
from jaxmoe.config import ConfigError, MeshConfig, MoEConfig, config_from_dict
from jaxmoe.model.dispatch import buffer_slots, capacity, dense_dispatch, packed_slots
from jaxmoe.model.experts import ExpertWeights
from jaxmoe.model.layout import LocalLayout
from jaxmoe.model.moe import MoE
from jaxmoe.model.router import Routing, route
from jaxmoe.ops.kernels import Kernels
from jaxmoe.parallel import ragged_cpu
from jaxmoe.parallel.ep_dispatch import ragged_plan
from jaxmoe.parallel.layout import GlobalLayout, dispatch_on_mesh, layout_for
from jaxmoe.parallel.sharding import BATCH_AXES, make_mesh, per_device_shapes
from jaxmoe.plan.collectives import compiled_collectives
from jaxmoe.step import build_steps

E, K, D, F, T = 8, 2, 16, 32, 64
MESHES = [(2, 4), (1, 8)]
# fp32 sums reordered between dispatchers, of at most a few hundred terms (T * K
# copies into a weight gradient, 2F into an output): rounding stays near
# sqrt(n) x 2^-24 ~ 1e-6 of the terms' size, 10x under these tolerances.
ATOL = 1e-5


def _cfg(dispatcher="dense", factor=E / K):
    # factor E / K makes every buffer hold every token it could get (C = Tl per device,
    # R Tl pooled over an expert group): nothing can overflow.
    # global balance scope: the loss must not depend on how the batch is split
    return MoEConfig(num_experts=E, top_k=K, expert_hidden=F, dispatcher=dispatcher,
                     capacity_factor=factor, balance_scope="global")


def _mesh(data, expert):
    return make_mesh(MeshConfig(data=data, expert=expert))


def _weights(key):
    k1, k2 = jax.random.split(key)
    return ExpertWeights(0.3 * jax.random.normal(k1, (E, D, 2 * F)),
                         0.3 * jax.random.normal(k2, (E, F, D)))


def _with_gates(routing: Routing, gate_TxK) -> Routing:
    return routing._replace(gate_TxK=gate_TxK)


def _dispatch_vjp(name, cfg, mesh, batched=False, expert_gemm=None):
    """One compiled program: y, dropped and the grads of sum(y * ct) w.r.t. x, gates, weights.

    batched: vmapped over a leading axis of every argument. expert_gemm: the grouped
    GEMM's implementation to run on the packed rows (None: the devices' choice).
    """
    layout = layout_for(None, mesh)
    if expert_gemm is not None:
        layout = GlobalLayout(mesh) if mesh is not None else LocalLayout()
        layout.kernels = layout.kernels.with_expert_gemm(expert_gemm)

    def run(x_TxD, expert_TxK, gate_TxK, w, ct_TxD):
        def f(x, g, w):
            r = Routing(expert_TxK, g, None, None, None)
            out = layout.dispatch(x, r, w, dataclasses.replace(cfg, dispatcher=name))
            return out.y_TxD, out.dropped
        (y, dropped), vjp = jax.vjp(f, x_TxD, gate_TxK, w)
        grads = vjp((ct_TxD, np.zeros((), jax.dtypes.float0)))
        return y, dropped, grads
    return jax.jit(jax.vmap(run) if batched else run)


def _place(mesh, x, routing, w, ct):
    tok = NamedSharding(mesh, P(BATCH_AXES))
    exp = NamedSharding(mesh, P("expert"))
    return (jax.device_put(x, tok), jax.device_put(routing.expert_TxK, tok),
            jax.device_put(routing.gate_TxK, tok), jax.device_put(w, exp),
            jax.device_put(ct, tok))


@pytest.fixture(scope="module")
def dense():
    return _dispatch_vjp("dense", _cfg(), None)


@pytest.fixture(scope="module")
def problem(dense):
    kx, kl, kw, kc = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (T, D))
    routing = route(jax.random.normal(kl, (T, E)), _cfg())
    w = _weights(kw)
    ct = jax.random.normal(kc, (T, D))
    ref = dense(x, routing.expert_TxK, routing.gate_TxK, w, ct)
    # A wrong reference: one token's first gate perturbed.
    bad = dense(x, routing.expert_TxK, routing.gate_TxK.at[5, 0].add(0.3), w, ct)
    return x, routing, w, ct, ref, bad


def _close(a, b, atol=ATOL):
    return bool(np.allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5))


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"data{s[0]}xexpert{s[1]}")
@pytest.mark.parametrize("name", ["alltoall", "allgather"])
def test_ep_matches_dense(problem, name, shape):
    x, routing, w, ct, (y_ref, _, g_ref), (y_bad, _, g_bad) = problem
    mesh = _mesh(*shape)
    y, dropped, grads = _dispatch_vjp(name, _cfg(name), mesh)(*_place(mesh, x, routing, w, ct))

    assert int(dropped) == 0
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(BATCH_AXES)), 2)
    assert per_device_shapes(y) == {(T // 8, D)}
    assert per_device_shapes(grads[0]) == {(T // 8, D)}
    assert _close(y, y_ref)
    g_x, g_gate, (g_up, g_down) = grads
    r_x, r_gate, (r_up, r_down) = g_ref
    for got, want in [(g_x, r_x), (g_gate, r_gate), (g_up, r_up), (g_down, r_down)]:
        assert got.shape == want.shape and _close(got, want)
    # ... and the comparison has teeth: a perturbed gate is caught in y and in dL/dx.
    assert not _close(y, y_bad, atol=1e-3)
    assert not _close(g_x, g_bad[0], atol=1e-3)


def test_alltoall_fsdp_weights_are_regathered(problem):
    """Under fsdp the weights' D dim is split over data too; in_specs P("expert") re-gathers."""
    x, routing, w, ct, (y_ref, _, _), (y_bad, _, _) = problem
    mesh = _mesh(2, 4)
    fsdp_w = ExpertWeights(
        jax.device_put(w.w_gate_up_ExDx2F, NamedSharding(mesh, P("expert", "data"))),
        jax.device_put(w.w_down_ExFxD, NamedSharding(mesh, P("expert", None, "data"))))
    assert per_device_shapes(fsdp_w.w_gate_up_ExDx2F) == {(E // 4, D // 2, 2 * F)}
    tok = NamedSharding(mesh, P(BATCH_AXES))
    cfg = _cfg("alltoall")
    y = jax.jit(lambda *a: dispatch_on_mesh(*a, cfg, mesh).y_TxD)(
        jax.device_put(x, tok), jax.tree.map(lambda a: jax.device_put(a, tok), routing), fsdp_w)
    assert _close(y, y_ref) and not _close(y, y_bad, atol=1e-3)


def _kept_mask(expert_TxK, cap, n_shards, shared=1):
    """NumPy: which copies find room. Each expert's buffer of `cap` rows is filled by
    `shared` consecutive device shards (1: each device its own, as `grouped` and
    `alltoall`; R: an expert group's, as `ragged` and `allgather`), shard by shard,
    k-major (arrival order) within a shard."""
    expert_TxK = np.asarray(expert_TxK)
    Tl = expert_TxK.shape[0] // n_shards
    kept = np.zeros(expert_TxK.shape, bool)
    for group in range(n_shards // shared):
        used = np.zeros(E, int)
        for s in range(group * shared, (group + 1) * shared):
            for k in range(K):
                for t in range(s * Tl, (s + 1) * Tl):
                    e = expert_TxK[t, k]
                    kept[t, k] = used[e] < cap
                    used[e] += 1
    return kept


@pytest.fixture(scope="module")
def tight_alltoall():
    mesh = _mesh(2, 4)
    cfg = _cfg("alltoall", factor=1.0)
    return mesh, cfg, _dispatch_vjp("alltoall", cfg, mesh)


def test_alltoall_drops_when_one_expert_takes_everything(problem, tight_alltoall):
    x, _, w, ct, _, _ = problem
    mesh, cfg, run = tight_alltoall
    Tl = T // 8
    C = capacity(Tl, K, E, cfg.capacity_factor)
    assert C == 2
    logits = 0.1 * jax.random.normal(jax.random.key(1), (T, E))
    logits = logits.at[:, 0].add(10.0).at[:, 1].add(5.0)  # every token: expert 0, then 1
    routing = route(logits, cfg)
    assert np.all(np.asarray(routing.expert_TxK) == [0, 1])
    y, dropped, _ = run(*_place(mesh, x, routing, w, ct))

    # Each device sends Tl copies to expert 0 and Tl to expert 1, C of each fit.
    assert int(dropped) == 8 * 2 * (Tl - C) == 96
    assert np.all(np.isfinite(np.asarray(y)))
    # Kept: the first C local tokens, for both choices; the rest get no expert output.
    kept_T = (np.arange(T) % Tl) < C
    kept_gates = routing.gate_TxK * kept_T[:, None]
    y_kept = dense_dispatch(x, _with_gates(routing, kept_gates), w, cfg).y_TxD
    y_all = dense_dispatch(x, routing, w, cfg).y_TxD
    assert _close(y, y_kept)
    assert np.all(np.asarray(y)[~kept_T] == 0)
    assert _close(np.asarray(y)[kept_T], np.asarray(y_all)[kept_T])
    assert not _close(np.asarray(y)[~kept_T], np.asarray(y_all)[~kept_T], atol=1e-3)


@jax.jit
def _dense_with_kept_vjp(x_TxD, expert_TxK, gate_TxK, kept_TxK, w, ct_TxD):
    """The dense reference with dropped copies' gates zeroed, and its vjp."""
    def f(x, g, w):
        r = Routing(expert_TxK, g * kept_TxK, None, None, None)
        return dense_dispatch(x, r, w, _cfg()).y_TxD
    y, vjp = jax.vjp(f, x_TxD, gate_TxK, w)
    return y, vjp(ct_TxD)


def _assert_survivors(got, kept, x, routing, w, ct, full):
    """(y, dropped, grads) are those of the kept copies alone, and unlike the no-drop
    answer `full` in y and in every gradient."""
    y, dropped, grads = got
    y_kept, g_kept = _dense_with_kept_vjp(x, routing.expert_TxK, routing.gate_TxK,
                                          jnp.asarray(kept, jnp.float32), w, ct)
    assert int(dropped) == (~kept).sum()
    assert _close(y, y_kept)
    for got_g, want in zip(jax.tree.leaves(grads), jax.tree.leaves(g_kept)):  # x, gates, w
        assert _close(got_g, want)
    assert np.all(np.asarray(grads[1])[~kept] == 0)  # a dropped copy's gate does nothing
    y_full, _, g_full = full
    assert not _close(y, y_full, atol=1e-3)
    for got_g, want in zip(jax.tree.leaves(grads), jax.tree.leaves(g_full)):
        assert not _close(got_g, want, atol=1e-3)


@pytest.mark.parametrize("name", ["grouped", "alltoall"])
def test_drops_match_numpy_keep_mask_with_gradients(problem, tight_alltoall, name):
    """Capacity 1.0 drops some copies: outputs and gradients are those of the survivors."""
    x, routing, w, ct, full, _ = problem
    if name == "grouped":
        cfg = _cfg("grouped", factor=1.0)
        run, args, n_dev = _dispatch_vjp("grouped", cfg, None), (
            x, routing.expert_TxK, routing.gate_TxK, w, ct), 1
    else:
        mesh, cfg, run = tight_alltoall
        args, n_dev = _place(mesh, x, routing, w, ct), 8
    kept = _kept_mask(routing.expert_TxK, capacity(T // n_dev, K, E, cfg.capacity_factor), n_dev)
    assert 0 < (~kept).sum() < kept.size  # this routing overflows some buffers, not all
    _assert_survivors(run(*args), kept, x, routing, w, ct, full)


@pytest.fixture(scope="module")
def tight_pooled():
    """ragged and allgather at capacity 1.0 on data 2 x expert 4, compiled once."""
    mesh, cfg = _mesh(2, 4), _cfg(factor=1.0)
    return mesh, cfg, {name: _dispatch_vjp(name, cfg, mesh) for name in ("ragged", "allgather")}


@pytest.mark.parametrize("name", ["ragged", "allgather"])
def test_pooled_drops_match_numpy_keep_mask_with_gradients(problem, tight_pooled,
                                                           tight_alltoall, name):
    """Buffers shared by an expert group's sources: the survivors' outputs and gradients,
    and fewer drops than `alltoall`'s per-device buffers at the same capacity factor,
    which hold as many rows in all."""
    x, routing, w, ct, full, _ = problem
    mesh, cfg, runs = tight_pooled
    R = mesh.shape["expert"]
    C = capacity(R * T // 8, K, E, cfg.capacity_factor)
    assert C == R * capacity(T // 8, K, E, cfg.capacity_factor) == 8
    kept = _kept_mask(routing.expert_TxK, C, 8, shared=R)
    assert 0 < (~kept).sum() < kept.size
    _assert_survivors(runs[name](*_place(mesh, x, routing, w, ct)), kept, x, routing, w, ct,
                      full)
    _, _, alltoall = tight_alltoall
    assert int(alltoall(*_place(mesh, x, routing, w, ct))[1]) > (~kept).sum()


@pytest.mark.parametrize("factor", [E / K, 1.0], ids=["roomy", "tight"])
@pytest.mark.parametrize("name", ["grouped", "alltoall", "allgather", "ragged"])
def test_packed_rows_for_the_grouped_gemm_change_nothing(problem, name, factor):
    """The packed layouts a grouped GEMM runs on (GPU) against the per-expert buffers
    (CPU's fast path), with tokamax's reference implementation as the GEMM: the same
    outputs, drops and gradients, with and without drops, on data 2 x expert 4."""
    x, routing, w, ct, _, (y_bad, _, g_bad) = problem
    mesh = None if name == "grouped" else _mesh(2, 4)
    cfg = _cfg(name, factor)
    args = (x, routing.expert_TxK, routing.gate_TxK, w, ct) if mesh is None else \
        _place(mesh, x, routing, w, ct)
    y, dropped, grads = _dispatch_vjp(name, cfg, mesh)(*args)
    y_p, dropped_p, grads_p = _dispatch_vjp(name, cfg, mesh, expert_gemm="xla")(*args)
    assert int(dropped_p) == int(dropped) and (int(dropped) > 0) == (factor == 1.0)
    assert _close(y_p, y)
    for got, want in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads)):  # x, gates, w
        assert _close(got, want)
    assert not _close(y_p, y_bad, atol=1e-3) and not _close(grads_p[0], g_bad[0], atol=1e-3)


def test_packed_slots_pack_what_the_buffers_spread():
    """Companion: the packed rows are a different placement of the same kept copies;
    expert e's rows follow the kept rows of the experts before it."""
    expert_N = jnp.asarray([2, 0, 2, 2, 0, 3, 2])
    slot_N, kept_N = buffer_slots(expert_N, 4, 2)
    packed_N, kept_p_N, rows_E = packed_slots(expert_N, 4, 2)
    np.testing.assert_array_equal(kept_p_N, kept_N)
    np.testing.assert_array_equal(rows_E, [2, 0, 2, 1])
    np.testing.assert_array_equal(slot_N, [4, 0, 5, 8, 1, 6, 8])
    np.testing.assert_array_equal(packed_N, [2, 0, 3, 8, 1, 4, 8])


@pytest.mark.parametrize("name", ["alltoall", "allgather", "ragged"])
def test_ep_dispatch_without_mesh_is_rejected(problem, name):
    x, routing, w, *_ = problem
    with pytest.raises(ValueError, match="moe.dispatcher"):
        dispatch_on_mesh(x, routing, w, _cfg(name), None)


# ------------------------------------------------------------------ ragged


def _plan_numpy(counts, rank, El, C):
    """Reference offsets by direct enumeration of each receiver's [El, C] layout."""
    R, E_ = counts.shape
    start = {}  # (src, e) -> row in src's expert-sorted send buffer
    for s in range(R):
        pos = 0
        for e in range(E_):
            start[s, e] = pos
            pos += counts[s, e]
    place, kept = {}, {}  # (src, e) -> receiver row, rows that fit
    for e in range(E_):
        pos = 0
        for s in range(R):
            kept[s, e] = max(0, min(counts[s, e], C - pos))
            place[s, e] = (e % El) * C + pos if kept[s, e] else 0
            pos += counts[s, e]
    mine = [r * El + le for r in range(R) for le in range(El)]
    from_src = [(s, rank * El + le) for s in range(R) for le in range(El)]
    fwd = ([start[rank, e] for e in mine], [kept[rank, e] for e in mine],
           [place[rank, e] for e in mine], [kept[s, e] for s, e in from_src])
    bwd = ([place[s, e] for s, e in from_src], [kept[s, e] for s, e in from_src],
           [start[s, e] for s, e in from_src], [kept[rank, e] for e in mine])
    dropped = sum(counts[rank, e] - kept[rank, e] for e in mine)
    return fwd, bwd, dropped


def _ragged_all_to_all_numpy(operands, outputs, args):
    """The documented semantics of lax.ragged_all_to_all, one list entry per rank."""
    R = len(operands)
    results = [o.copy() for o in outputs]
    for src in range(R):
        in_off, send, out_off, _ = args[src]
        per = len(in_off) // R
        for i in range(len(in_off)):
            dst = i // per
            rows = operands[src][in_off[i]:in_off[i] + send[i]]
            results[dst][out_off[i]:out_off[i] + send[i]] = rows
    for dst in range(R):  # recv_sizes must be what each source sends here
        _, _, _, recv = args[dst]
        per = len(recv) // R
        for src in range(R):
            np.testing.assert_array_equal(recv[src * per:(src + 1) * per],
                                          args[src][1][dst * per:(dst + 1) * per])
    return results


@pytest.mark.parametrize("C", [12, 5], ids=["roomy", "tight"])
def test_ragged_plan_matches_numpy_and_round_trips(C):
    R, El = 4, 2
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, size=(R, R * El))
    counts[1, :] = 0  # a rank that sends nothing
    counts[:, 3] = 0  # an expert nobody picks
    plans = [jax.tree.map(np.asarray, ragged_plan(jnp.asarray(counts), jnp.int32(r), El, C))
             for r in range(R)]
    load_E = counts.sum(0)
    assert (load_E.max() <= C) == (C == 12)  # roomy holds every copy, tight does not
    for r, plan in enumerate(plans):
        fwd, bwd, dropped = _plan_numpy(counts, r, El, C)
        np.testing.assert_array_equal(np.stack(plan.forward), np.array(fwd))
        np.testing.assert_array_equal(np.stack(plan.backward), np.array(bwd))
        assert int(plan.dropped) == dropped
    assert sum(int(p.dropped) for p in plans) == np.maximum(load_E - C, 0).sum()

    # Exchange row ids under the documented semantics: every receiver's buffer comes
    # out as [El, C] rows, the sources in order in each expert's, the kept rows only;
    # the reverse exchange restores the kept rows of every sender.
    N = counts.sum(1).max()
    sent = []
    for s in range(R):  # tag rows with (source, expert, row) so placement is checkable
        rows = [(s, e, i) for e in range(R * El) for i in range(counts[s, e])]
        sent.append(np.array(rows + [(-1, -1, -1)] * (N - len(rows)), np.int64).reshape(N, 3))
    recv = _ragged_all_to_all_numpy(sent, [np.full((El * C, 3), -1)] * R,
                                    [p.forward for p in plans])
    for r in range(R):
        for le in range(El):
            e = r * El + le
            expect = [(s, e, i) for s in range(R) for i in range(counts[s, e])][:C]
            got = recv[r][le * C:(le + 1) * C]
            np.testing.assert_array_equal(got[:len(expect)], np.array(expect).reshape(-1, 3))
            assert np.all(got[len(expect):] == -1)
    back = _ragged_all_to_all_numpy(recv, [np.full((N, 3), -1)] * R,
                                    [p.backward for p in plans])
    for s in range(R):
        returned = back[s][:, 0] != -1
        np.testing.assert_array_equal(back[s][returned], sent[s][returned])
        assert returned.sum() == counts[s].sum() - int(plans[s].dropped)
    assert not np.array_equal(back[0], sent[2])  # distinct buffers: the check can fail


@pytest.fixture(scope="module")
def ragged_run():
    """The ragged dispatcher's program per mesh shape, compiled once and reused."""
    runs = {}

    def get(shape):
        if shape not in runs:
            mesh = _mesh(*shape)
            runs[shape] = mesh, _dispatch_vjp("ragged", _cfg("ragged"), mesh)
        return runs[shape]
    return get


def _assert_matches(got, want, bad):
    """(y, dropped, grads) against a reference, and unlike a perturbed one in y and dL/dx."""
    (y, dropped, grads), (y_ref, _, g_ref), (y_bad, _, g_bad) = got, want, bad
    assert int(dropped) == 0
    assert per_device_shapes(y) == {(T // 8, D)}
    assert _close(y, y_ref) and not _close(y, y_bad, atol=1e-3)
    for got_g, want_g in zip(jax.tree.leaves(grads), jax.tree.leaves(g_ref)):  # x, gates, w
        assert got_g.shape == want_g.shape and _close(got_g, want_g)
    assert not _close(grads[0], g_bad[0], atol=1e-3)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"data{s[0]}xexpert{s[1]}")
def test_ragged_dispatch_runs_on_cpu_and_matches_dense(problem, ragged_run, shape):
    """The real dispatcher and JAX's own transpose of ragged_all_to_all, on the CPU lowering."""
    x, routing, w, ct, ref, bad = problem
    mesh, run = ragged_run(shape)
    _assert_matches(run(*_place(mesh, x, routing, w, ct)), ref, bad)


def _skewed_routing():
    """Most copies to experts 0, 1 (rank 0 of 4), none to 6, 7 (rank 3 receives nothing)."""
    logits = jax.random.normal(jax.random.key(5), (T, E))
    hot_T = jax.random.uniform(jax.random.key(6), (T,)) < 0.8
    logits = logits.at[:, :2].add(jnp.where(hot_T, 10.0, 0.0)[:, None])
    routing = route(logits.at[:, 6:].add(-100.0), _cfg())
    counts_E = np.bincount(np.asarray(routing.expert_TxK).ravel(), minlength=E)
    assert counts_E[6:].sum() == 0 and counts_E[:2].sum() > 0.75 * T * K
    return routing


def test_ragged_dispatch_skewed_routing(problem, dense, ragged_run):
    """Very uneven receive buffers and empty groups."""
    x, _, w, ct, _, _ = problem
    mesh, run = ragged_run((2, 4))
    routing = _skewed_routing()
    ref = dense(x, routing.expert_TxK, routing.gate_TxK, w, ct)
    bad = dense(x, routing.expert_TxK, routing.gate_TxK.at[5, 0].add(0.3), w, ct)
    _assert_matches(run(*_place(mesh, x, routing, w, ct)), ref, bad)


def test_ragged_dispatch_under_vmap(problem, dense):
    """A batch of two problems runs ragged_all_to_all's batching rule at size 2."""
    x, routing, w, ct, (y_ref, _, g_ref), _ = problem
    skewed, w2 = _skewed_routing(), _weights(jax.random.key(7))
    x2, ct2 = x[::-1], ct[::-1]
    ref2 = dense(x2, skewed.expert_TxK, skewed.gate_TxK, w2, ct2)
    mesh = _mesh(2, 4)
    # each problem with its own weights
    pairs = [(x, x2), (routing.expert_TxK, skewed.expert_TxK),
             (routing.gate_TxK, skewed.gate_TxK), (w, w2), (ct, ct2)]
    specs = [P(None, BATCH_AXES)] * 3 + [P(None, "expert"), P(None, BATCH_AXES)]
    args = [jax.device_put(jax.tree.map(lambda *ab: jnp.stack(ab), a, b), NamedSharding(mesh, spec))
            for (a, b), spec in zip(pairs, specs)]
    y, dropped, grads = _dispatch_vjp("ragged", _cfg("ragged"), mesh, batched=True)(*args)
    assert np.all(np.asarray(dropped) == 0)
    for i, (y_i, _, g_i) in enumerate([(y_ref, None, g_ref), ref2]):
        assert _close(y[i], y_i)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(g_i)):  # x, gates, w
            assert _close(got[i], want)
    assert not _close(y[0], y[1], atol=1e-3)  # teeth: the two problems differ


def test_ragged_on_cpu_without_the_private_jax_names_is_a_config_error(monkeypatch):
    import jax._src.lax.parallel as jax_parallel
    monkeypatch.setattr(ragged_cpu, "_installed", False)
    monkeypatch.delattr(jax_parallel, "ragged_all_to_all_p")
    with pytest.raises(ConfigError, match="^moe.dispatcher: 'ragged' on CPU"):
        ragged_cpu.install_cpu_lowering()


_A2A = re.compile(r"stablehlo\.all_to_all.*: \(tensor<([^>]*)>\)")


def test_ragged_lowers_to_the_real_op_for_gpu_and_the_padded_one_for_cpu(problem, ragged_run):
    x, routing, w, ct, _, _ = problem
    mesh, run = ragged_run((2, 4))
    traced = run.trace(*_place(mesh, x, routing, w, ct))
    gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert gpu.count("custom_call @ragged_all_to_all") == 4  # two forward, two transposed
    # JAX's transpose rule exchanges the [E] int32 offsets; no row ever goes through all_to_all.
    assert _A2A.findall(gpu) == [f"{E}xi32"] * 4
    assert "ragged_all_to_all" not in cpu
    moved_rows = [t for t in _A2A.findall(cpu) if t.endswith("f32")]
    assert len(moved_rows) == 4  # the padded stand-in: one per exchange


# ------------------------------------------------------------------ through the MoE module


def _moe(cfg):
    """(state, the MoE layer's compiled program (state, x, mesh) -> (y, aux))."""
    moe = MoE(D, cfg, 0.3, 0.3, nnx.Rngs(0))
    graphdef, state = nnx.split(moe)
    return state, jax.jit(lambda s, x, m: nnx.merge(graphdef, s)(x, layout_for(None, m)),
                          static_argnums=2)


def test_moe_module_ep_matches_dense():
    B, L = 8, 8
    x = jax.random.normal(jax.random.key(4), (B, L, D))
    mesh = _mesh(2, 4)
    ref_state, dense = _moe(_cfg("dense"))
    y_ref, aux_ref = dense(ref_state, x, None)
    xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
    for name, factor, drops in [("alltoall", E / K, False), ("alltoall", 0.5, True),
                                ("ragged", E / K, False), ("ragged", 0.5, True)]:
        state, ep = _moe(_cfg(name, factor))
        assert all(np.array_equal(a, b) for a, b in
                   zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)))
        y, aux = ep(state, xs, mesh)
        assert per_device_shapes(y) == {(B // 8, L, D)}
        # counts is requested load, before any drop: the same either way.
        np.testing.assert_array_equal(aux["counts"], aux_ref["counts"])
        assert _close(aux["balance_loss"], aux_ref["balance_loss"])
        assert (int(aux["dropped"]) > 0) == drops
        assert _close(y, y_ref) != drops


def test_group_limited_routing_through_every_ep_dispatcher():
    """Routing groups pick the experts before dispatch: with them, every expert-parallel
    dispatcher's MoE layer equals dense's, and they moved the experts' loads."""
    x = jax.random.normal(jax.random.key(5), (8, 8, D))
    mesh = _mesh(2, 4)
    xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
    groups = lambda name: dataclasses.replace(_cfg(name), routing_groups=4,  # noqa: E731
                                              groups_per_token=1)
    state, dense = _moe(groups("dense"))
    y_ref, aux_ref = dense(state, x, None)
    _, ungrouped = _moe(_cfg("dense"))
    assert not np.array_equal(ungrouped(state, x, None)[1]["counts"], aux_ref["counts"])
    for name in ("alltoall", "allgather", "ragged"):
        _, ep = _moe(groups(name))
        y, aux = ep(state, xs, mesh)
        np.testing.assert_array_equal(aux["counts"], aux_ref["counts"])
        assert int(aux["dropped"]) == 0 and _close(y, y_ref), name


# ------------------------------------------------------------------ through a train step

STEP = {
    "model": {"d_model": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2},
    "moe": {"num_experts": E, "top_k": K, "expert_hidden": F, "balance_scope": "global"},
    "train": {"steps": 1, "batch_size": 16, "seq_len": 16},
    "optimizer": {"warmup_steps": 0},
    "mesh": {"data": 2, "expert": 4},
}
TOKENS = np.random.default_rng(0).integers(0, 256, (16, 17), dtype=np.int32)


def _step_config(dispatcher, factor, **moe):
    return config_from_dict({**STEP, "moe": {**STEP["moe"], "dispatcher": dispatcher,
                                             "capacity_factor": factor, **moe}})


def _train_step(dispatcher, factor, init=None, **moe):
    """One compiled train step from a fixed initial state (built here unless given):
    tokens -> (loss, grad norm, drops, the gradients' first moment), and that state."""
    cfg = _step_config(dispatcher, factor, **moe)
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    init = jax.device_get(steps.init(jax.random.PRNGKey(0))) if init is None else init

    def run(tokens):
        state = jax.device_put(init, steps.state_shardings)
        state, m = steps.train_step(state, jax.device_put(tokens, steps.batch_sharding))
        return (float(m["loss"]), float(m["grad_norm"]), float(m["drop_fraction"].sum()),
                jax.device_get(state.opt_state.mu))
    return run, init


def test_ragged_train_step_equals_alltoall_without_drops():
    """The same math on 8 devices: a capacity of E / K x the uniform share drops nothing."""
    alltoall, init = _train_step("alltoall", E / K)
    ragged, _ = _train_step("ragged", E / K, init)  # the dispatcher does not change the weights
    loss, norm, drops, mu = ragged(TOKENS)
    ref_loss, ref_norm, ref_drops, ref_mu = alltoall(TOKENS)
    assert drops == ref_drops == 0
    # a loss over 256 tokens and a norm over every gradient: reordered fp32 sums
    assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
    close = lambda a, b: _close(a, b, atol=1e-5 * float(np.abs(b).max()))  # noqa: E731
    assert all(jax.tree.leaves(jax.tree.map(close, mu, ref_mu)))
    # teeth: one sequence changed moves the expert weights' gradients beyond that tolerance
    other = TOKENS.copy()
    other[3] = np.roll(other[3], 1)
    *_, other_mu = alltoall(other)
    experts = lambda m: m["moe_layers"]["moe"]["experts"]  # noqa: E731
    assert not any(jax.tree.leaves(jax.tree.map(close, experts(other_mu), experts(ref_mu))))


@pytest.mark.parametrize("name", ["alltoall", "ragged"])
def test_exchange_in_chunks_equals_one_exchange(name):
    """`moe.exchange_chunks: 2`: a layer's tokens dispatched in two halves, each with
    its own exchanges and expert GEMMs, on 8 devices without drops: the loss, norm and
    gradients of one exchange (reordered fp32 sums, as above; twice the gradient
    fails), and the program holds twice the token exchanges, the same bytes in all.
    Companion: a chunk count that does not divide a device's tokens is refused by
    name."""
    whole, init = _train_step(name, E / K)
    halves, _ = _train_step(name, E / K, init, exchange_chunks=2)
    ref_loss, ref_norm, ref_drops, ref_mu = whole(TOKENS)
    loss, norm, drops, mu = halves(TOKENS)
    assert drops == ref_drops == 0
    assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
    close = lambda a, b: _close(a, b, atol=1e-5 * float(np.abs(b).max()))  # noqa: E731
    assert all(jax.tree.leaves(jax.tree.map(close, mu, ref_mu)))
    assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: close(2 * a, b), mu, ref_mu)))

    def exchanges(chunks):
        cfg = _step_config(name, E / K, exchange_chunks=chunks)
        steps = build_steps(cfg, make_mesh(cfg.mesh))
        batch = jax.ShapeDtypeStruct((16, 17), jnp.int32, sharding=steps.batch_sharding)
        ops = compiled_collectives(steps.train_step.lower(abstract_target(steps), batch).compile())
        rows = [c for c in ops if "dispatch" in c.op_name and c.kind == "all-to-all"]
        return len(rows), sum(c.sent_bytes * c.runs for c in rows)

    (one, one_bytes), (two, two_bytes) = exchanges(1), exchanges(2)
    # the same token rows in all; the ragged exchange adds each chunk's E counts (int32)
    assert two == 2 * one > 0 and two_bytes == pytest.approx(one_bytes, rel=1e-3)
    with pytest.raises(ValueError, match="moe.exchange_chunks"):
        _train_step(name, E / K, init, exchange_chunks=3)[0](TOKENS)


def test_train_step_on_packed_rows_equals_the_buffers(monkeypatch):
    """The ddp step (its weights typed per device inside the step's shard_map) with the
    experts on packed rows through a grouped GEMM, as on GPU, against the buffers, at a
    capacity that drops: the same loss, drops and gradients."""
    buffers, init = _train_step("alltoall", 1.0)
    ref_loss, ref_norm, ref_drops, ref_mu = buffers(TOKENS)
    asked = []
    monkeypatch.setattr(Kernels, "grouped_gemm",
                        lambda self, cfg, d_model=None: asked.append(cfg) or "xla")
    packed, _ = _train_step("alltoall", 1.0, init)
    loss, norm, drops, mu = packed(TOKENS)
    assert asked  # the step took the packed path
    assert drops == ref_drops > 0
    assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
    close = lambda a, b: _close(a, b, atol=1e-5 * float(np.abs(b).max()))  # noqa: E731
    assert all(jax.tree.leaves(jax.tree.map(close, mu, ref_mu)))


@pytest.mark.parametrize("name", ["grouped", "alltoall", "allgather", "ragged"])
def test_mxfp8_packed_rows_match_the_buffers(name):
    """MXFP8 experts on packed rows, each expert's from a multiple of 256 (the grouped
    block-scaled GEMMs' contract in XLA, what CPU runs of cuDNN's kernels), against the
    same experts over per-expert buffers (`mx_linear`): the same quantised products, so
    the same outputs, drops and gradients up to fp32 summation order, with drops, on
    data 2 x expert 4. Companion: bf16 experts differ by MXFP8's rounding."""
    Dm = 32  # MXFP8 blocks 32 values of the contracted axis
    kx, kl, kw, kc = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(kx, (T, Dm))
    cfg = dataclasses.replace(_cfg(name, 1.0), expert_precision="mxfp8")
    routing = route(jax.random.normal(kl, (T, E)), cfg)
    k1, k2 = jax.random.split(kw)
    w = ExpertWeights(0.3 * jax.random.normal(k1, (E, Dm, 2 * F)),
                      0.3 * jax.random.normal(k2, (E, F, Dm)))
    ct = jax.random.normal(kc, (T, Dm))
    mesh = None if name == "grouped" else _mesh(2, 4)
    args = (x, routing.expert_TxK, routing.gate_TxK, w, ct) if mesh is None else \
        _place(mesh, x, routing, w, ct)
    y, dropped, grads = _dispatch_vjp(name, cfg, mesh)(*args)
    y_p, dropped_p, grads_p = _dispatch_vjp(name, cfg, mesh, expert_gemm="xla")(*args)
    assert int(dropped_p) == int(dropped) > 0
    assert _close(y_p, y)
    for got, want in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads)):  # x, gates, w
        assert _close(got, want)
    bf16 = dataclasses.replace(cfg, expert_precision="compute")
    y_bf16, _, _ = _dispatch_vjp(name, bf16, mesh, expert_gemm="xla")(*args)
    assert not _close(y_p, y_bf16, atol=1e-3)
