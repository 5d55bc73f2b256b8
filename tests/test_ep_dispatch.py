"""Expert-parallel dispatchers against the single-device references, on 8 fake devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmoe.config import MeshConfig, MoEConfig
from jaxmoe.model.dispatch import capacity, dense_dispatch, get_dispatcher
from jaxmoe.model.experts import ExpertWeights, expert_ffn
from jaxmoe.model.moe import MoE
from jaxmoe.model.router import Routing, route
from jaxmoe.parallel import ep_dispatch
from jaxmoe.parallel.ep_dispatch import ragged_ffn, ragged_plan
from jaxmoe.sharding import BATCH_AXES, make_mesh, per_device_shapes

E, K, D, F, T = 8, 2, 16, 32, 64
MESHES = [(2, 4), (1, 8)]
ATOL = 1e-5


def _cfg(dispatcher="dense", factor=E / K):
    # factor E / K makes C = Tl: a device's copies cannot overflow one expert's buffer.
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


def _dispatch_vjp(name, cfg, mesh):
    """One compiled program: y, dropped and the grads of sum(y * ct) w.r.t. x, gates, weights."""
    def run(x_TxD, expert_TxK, gate_TxK, w, ct_TxD):
        def f(x, g, w):
            r = Routing(expert_TxK, g, None, None, None)
            out = get_dispatcher(name)(x, r, w, cfg, mesh)
            return out.y_TxD, out.dropped
        (y, dropped), vjp = jax.vjp(f, x_TxD, gate_TxK, w)
        grads = vjp((ct_TxD, np.zeros((), jax.dtypes.float0)))
        return y, dropped, grads
    return jax.jit(run)


def _place(mesh, x, routing, w, ct):
    tok = NamedSharding(mesh, P(BATCH_AXES))
    exp = NamedSharding(mesh, P("expert"))
    return (jax.device_put(x, tok), jax.device_put(routing.expert_TxK, tok),
            jax.device_put(routing.gate_TxK, tok), jax.device_put(w, exp),
            jax.device_put(ct, tok))


@pytest.fixture(scope="module")
def problem():
    kx, kl, kw, kc = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (T, D))
    routing = route(jax.random.normal(kl, (T, E)), _cfg())
    w = _weights(kw)
    ct = jax.random.normal(kc, (T, D))
    ref = _dispatch_vjp("dense", _cfg(), None)(x, routing.expert_TxK, routing.gate_TxK, w, ct)
    # A wrong reference: one token's first gate perturbed.
    bad_gate = routing.gate_TxK.at[5, 0].add(0.3)
    bad = _dispatch_vjp("dense", _cfg(), None)(x, routing.expert_TxK, bad_gate, w, ct)
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
    y = jax.jit(lambda *a: get_dispatcher("alltoall")(*a, cfg, mesh).y_TxD)(
        jax.device_put(x, tok), jax.tree.map(lambda a: jax.device_put(a, tok), routing), fsdp_w)
    assert _close(y, y_ref) and not _close(y, y_bad, atol=1e-3)


def _kept_mask(expert_TxK, cap, n_shards):
    """NumPy: which copies find room, per device shard, in k-major arrival order."""
    expert_TxK = np.asarray(expert_TxK)
    Tl = expert_TxK.shape[0] // n_shards
    kept = np.zeros(expert_TxK.shape, bool)
    for s in range(n_shards):
        used = np.zeros(E, int)
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


def test_alltoall_partial_drops_match_numpy(problem, tight_alltoall):
    x, routing, w, ct, (y_ref, _, _), _ = problem
    mesh, cfg, run = tight_alltoall
    C = capacity(T // 8, K, E, cfg.capacity_factor)
    kept = _kept_mask(routing.expert_TxK, C, 8)
    assert 0 < (~kept).sum() < kept.size  # this routing overflows some buffers, not all
    y, dropped, _ = run(*_place(mesh, x, routing, w, ct))
    assert int(dropped) == (~kept).sum()
    y_kept = dense_dispatch(x, _with_gates(routing, routing.gate_TxK * kept), w, cfg).y_TxD
    assert _close(y, y_kept) and not _close(y, y_ref, atol=1e-3)


@pytest.mark.parametrize("name", ["alltoall", "allgather", "ragged"])
def test_ep_dispatch_without_mesh_is_rejected(problem, name):
    x, routing, w, *_ = problem
    with pytest.raises(ValueError, match="moe.dispatcher"):
        get_dispatcher(name)(x, routing, w, _cfg(name), None)


# ------------------------------------------------------------------ ragged


def _plan_numpy(counts, rank, El):
    """Reference offsets by direct enumeration of each receiver's layout."""
    R, E_ = counts.shape
    start = {}  # (src, e) -> row in src's expert-sorted send buffer
    for s in range(R):
        pos = 0
        for e in range(E_):
            start[s, e] = pos
            pos += counts[s, e]
    place = {}  # (src, e) -> row in receiver e // El's buffer: by local expert, then by source
    for r in range(R):
        pos = 0
        for le in range(El):
            for s in range(R):
                place[s, r * El + le] = pos
                pos += counts[s, r * El + le]
    mine = [r * El + le for r in range(R) for le in range(El)]
    from_src = [(s, rank * El + le) for s in range(R) for le in range(El)]
    fwd = ([start[rank, e] for e in mine], [counts[rank, e] for e in mine],
           [place[rank, e] for e in mine], [counts[s, e] for s, e in from_src])
    bwd = ([place[s, e] for s, e in from_src], [counts[s, e] for s, e in from_src],
           [start[s, e] for s, e in from_src], [counts[rank, e] for e in mine])
    group = [sum(counts[s, rank * El + le] for s in range(R)) for le in range(El)]
    return fwd, bwd, group


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


def test_ragged_plan_matches_numpy_and_round_trips():
    R, El = 4, 2
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, size=(R, R * El))
    counts[1, :] = 0  # a rank that sends nothing
    counts[:, 3] = 0  # an expert nobody picks
    plans = [jax.tree.map(np.asarray, ragged_plan(jnp.asarray(counts), jnp.int32(r), El))
             for r in range(R)]
    for r, plan in enumerate(plans):
        fwd, bwd, group = _plan_numpy(counts, r, El)
        np.testing.assert_array_equal(np.stack(plan.forward), np.array(fwd))
        np.testing.assert_array_equal(np.stack(plan.backward), np.array(bwd))
        np.testing.assert_array_equal(plan.group_sizes_El, group)

    # Exchange row ids under the documented semantics: every receiver's buffer
    # comes out grouped by local expert, and the reverse exchange restores the senders.
    N = counts.sum(1).max()
    sent = []
    for s in range(R):  # tag rows with (source, expert, row) so placement is checkable
        rows = [(s, e, i) for e in range(R * El) for i in range(counts[s, e])]
        sent.append(np.array(rows + [(-1, -1, -1)] * (N - len(rows)), np.int64).reshape(N, 3))
    recv = _ragged_all_to_all_numpy(sent, [np.full((R * N, 3), -1)] * R,
                                    [p.forward for p in plans])
    for r in range(R):
        expect = [(s, r * El + le, i) for le in range(El) for s in range(R)
                  for i in range(counts[s, r * El + le])]
        got = recv[r][:len(expect)]
        np.testing.assert_array_equal(got, np.array(expect).reshape(-1, 3))
        assert np.all(recv[r][len(expect):] == -1)
        assert plans[r].group_sizes_El.sum() == len(expect)
    back = _ragged_all_to_all_numpy(recv, [np.full((N, 3), -1)] * R,
                                    [p.backward for p in plans])
    for s in range(R):
        np.testing.assert_array_equal(back[s], sent[s])
    assert not np.array_equal(back[0], sent[2])  # distinct buffers: the check can fail


def test_ragged_ffn_matches_expert_ffn():
    w = _weights(jax.random.key(2))
    sizes = np.array([3, 0, 5, 1, 7, 0, 2, 4])  # empty groups and unused tail rows
    M = sizes.sum() + 6
    x = jax.random.normal(jax.random.key(3), (M, D))
    y = np.asarray(jax.jit(ragged_ffn)(w, x, jnp.asarray(sizes, jnp.int32)))
    starts = np.cumsum(sizes) - sizes
    C = sizes.max()
    x_ExCxD = np.zeros((E, C, D), np.float32)
    for e in range(E):
        x_ExCxD[e, :sizes[e]] = np.asarray(x)[starts[e]:starts[e] + sizes[e]]
    y_ref = np.asarray(expert_ffn(w, jnp.asarray(x_ExCxD)))
    for e in range(E):
        assert _close(y[starts[e]:starts[e] + sizes[e]], y_ref[e, :sizes[e]])
    # Rows of group 0 through expert 1 are a different answer.
    assert not _close(y[:3], np.asarray(expert_ffn(w, jnp.asarray(x_ExCxD)))[1, :3], atol=1e-3)


def _ragged_all_to_all_via_all_to_all(operand, output, input_offsets, send_sizes,
                                      output_offsets, recv_sizes, *, axis_name,
                                      axis_index_groups=None):
    """lax.ragged_all_to_all emulated with all_to_all (XLA:CPU lacks the real one).

    Every rank sends each destination its whole buffer plus each row's target
    position there (out of range for rows not in that destination's slices).
    """
    R = lax.axis_size(axis_name)
    S, N, M = input_offsets.shape[0], operand.shape[0], output.shape[0]
    n = jnp.arange(N)
    inside_SxN = (n >= input_offsets[:, None]) & (n < (input_offsets + send_sizes)[:, None])
    pos_SxN = jnp.where(inside_SxN, output_offsets[:, None] + n - input_offsets[:, None], M)
    pos_RxN = pos_SxN.reshape(R, S // R, N).min(axis=1)
    rows_RxNxD = lax.all_to_all(jnp.broadcast_to(operand, (R,) + operand.shape),
                                axis_name, 0, 0, tiled=True)
    pos_RxN = lax.all_to_all(pos_RxN, axis_name, 0, 0, tiled=True)
    return output.at[pos_RxN.reshape(-1)].set(rows_RxNxD.reshape(R * N, -1), mode="drop")


def test_ragged_dispatch_matches_dense_with_emulated_exchange(problem, monkeypatch):
    """The real collective cannot run on CPU: check it lowers, then run the rest for real."""
    x, routing, w, ct, (y_ref, _, g_ref), (y_bad, _, _) = problem
    mesh = _mesh(2, 4)
    args = _place(mesh, x, routing, w, ct)
    run = _dispatch_vjp("ragged", _cfg("ragged"), mesh)
    hlo = run.lower(*args).as_text()
    assert hlo.count("custom_call @ragged_all_to_all") == 4  # two forward, two transposed

    monkeypatch.setattr(ep_dispatch.lax, "ragged_all_to_all", _ragged_all_to_all_via_all_to_all)
    y, dropped, grads = _dispatch_vjp("ragged", _cfg("ragged"), mesh)(*args)
    assert int(dropped) == 0
    assert per_device_shapes(y) == {(T // 8, D)}
    assert _close(y, y_ref) and not _close(y, y_bad, atol=1e-3)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(g_ref)):
        assert _close(got, want)


# ------------------------------------------------------------------ through the MoE module


def test_moe_module_alltoall_matches_dense():
    B, L = 8, 8
    x = jax.random.normal(jax.random.key(4), (B, L, D))
    mesh = _mesh(2, 4)

    def build(cfg):
        moe = MoE(D, cfg, 0.3, 0.3, nnx.Rngs(0))
        graphdef, state = nnx.split(moe)
        return state, jax.jit(lambda s, x, m: nnx.merge(graphdef, s)(x, m), static_argnums=2)

    ref_state, dense = build(_cfg("dense"))
    y_ref, aux_ref = dense(ref_state, x, None)
    xs = jax.device_put(x, NamedSharding(mesh, P(BATCH_AXES)))
    for factor, drops in [(E / K, False), (0.5, True)]:
        state, ep = build(_cfg("alltoall", factor))
        assert all(np.array_equal(a, b) for a, b in
                   zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)))
        y, aux = ep(state, xs, mesh)
        assert per_device_shapes(y) == {(B // 8, L, D)}
        # counts_E is requested load, before any drop: the same either way.
        np.testing.assert_array_equal(aux["counts_E"], aux_ref["counts_E"])
        assert _close(aux["balance_loss"], aux_ref["balance_loss"])
        assert (int(aux["dropped"]) > 0) == drops
        assert _close(y, y_ref) != drops
