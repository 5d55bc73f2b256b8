"""An interleaved 1F1B schedule as one SPMD program, against the circular schedule.

    python benchmarks/pipeline_1f1b.py [--stages 4] [--virtual 2] [--microbatches 8 16 32]

The mechanics a 1F1B pipeline in jaxmoe would need, on a stack of residual tanh
layers (no attention, no routing) under `shard_map` over S fake CPU devices:
`pipeline_schedules.py` schedules the forwards and backwards in lockstep, and
each iteration's ops are table lookups by (iteration, stage); a `lax.cond` skips
what a stage does not run; a stage keeps each chunk's input in a ring of K slots
(the `full` recomputation policy: the backward recomputes its chunk with `jax.vjp`);
the last chunk's backward computes its micro-batch's loss; activations and
cotangents that arrive before their op runs wait in mailboxes whose slots the
tables also assign. The circular schedule is jaxmoe's (`device_pipeline`):
autodiff of a loop that keeps every chunk's input.

Prints, for each micro-batch count M: the largest difference of the loss and the
gradients (weights, inputs) from the sequential model's, and each program's
compiled temporary memory on one device (`memory_analysis`), with the chunk
inputs each schedule holds.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from pipeline_schedules import fewest_held  # noqa: E402


def chunk(w_PxDxD, x_bxD):
    """One chunk: `per` residual layers."""
    return lax.scan(lambda x, w: (x + jnp.tanh(x @ w), None), x_bxD, w_PxDxD)[0]


def micro_loss(y_bxD, M: int):
    return jnp.sum(y_bxD ** 2) / (2 * M * y_bxD.size)


def sequential(w_WxSxPxDxD, x_MxbxD):
    W, S = w_WxSxPxDxD.shape[:2]
    M = x_MxbxD.shape[0]
    total = 0.0
    for m in range(M):
        x = x_MxbxD[m]
        for c in range(W * S):
            x = chunk(w_WxSxPxDxD[c // S, c % S], x)
        total = total + micro_loss(x, M)
    return total


def tables(schedule, S: int, W: int, M: int) -> dict[str, np.ndarray]:
    """Each iteration's ops on each stage, and the ring and mailbox slots they use."""
    C, T = S * W, schedule.iterations
    tab = {k: np.zeros((T, S), np.int32) for k in (
        "f_on", "f_m", "f_v", "f_first", "f_last", "f_mail", "f_ring",
        "b_on", "b_m", "b_v", "b_first", "b_last", "b_mail", "b_ring",
        "af_on", "af_slot", "ab_on", "ab_slot")}
    ring = [dict() for _ in range(S)]  # (m, c) -> slot, per stage
    fmail, bmail = [dict() for _ in range(S)], [dict() for _ in range(S)]
    sizes = {"ring": 0, "fmail": 0, "bmail": 0}
    fwd_at, bwd_at = {}, {}
    for (m, c), t in schedule.forward.items():
        fwd_at.setdefault(t, []).append((m, c))
    for (m, c), t in schedule.backward.items():
        bwd_at.setdefault(t, []).append((m, c))

    def take(slots: dict, key, what: str) -> int:
        used = set(slots.values())
        slot = next(i for i in range(len(used) + 1) if i not in used)
        slots[key] = slot
        sizes[what] = max(sizes[what], slot + 1)
        return slot

    for t in range(T):
        freed = []
        for m, c in fwd_at.get(t - 1, []):  # arrivals: sent at the end of t - 1
            if c + 1 < C:
                s = (c + 1) % S
                tab["af_on"][t, s], tab["af_slot"][t, s] = 1, take(fmail[s], (m, c + 1), "fmail")
        for m, c in bwd_at.get(t - 1, []):
            if c > 0:
                s = (c - 1) % S
                tab["ab_on"][t, s], tab["ab_slot"][t, s] = 1, take(bmail[s], (m, c - 1), "bmail")
        for m, c in fwd_at.get(t, []):
            s = c % S
            row = dict(f_on=1, f_m=m, f_v=c // S, f_first=c == 0, f_last=c == C - 1,
                       f_mail=fmail[s].get((m, c), 0), f_ring=take(ring[s], (m, c), "ring"))
            for k, v in row.items():
                tab[k][t, s] = v
            if c > 0:
                freed.append((fmail[s], (m, c)))
        for m, c in bwd_at.get(t, []):
            s = c % S
            row = dict(b_on=1, b_m=m, b_v=c // S, b_first=c == 0, b_last=c == C - 1,
                       b_mail=bmail[s].get((m, c), 0), b_ring=ring[s][(m, c)])
            for k, v in row.items():
                tab[k][t, s] = v
            freed.append((ring[s], (m, c)))
            if c < C - 1:
                freed.append((bmail[s], (m, c)))
        for slots, key in freed:  # reusable from the next iteration
            del slots[key]
    return tab, sizes


def one_f_one_b(mesh, S: int, W: int, M: int, cap: int):
    schedule = fewest_held(S, W, M, 2.0, most=cap)
    tab, sizes = tables(schedule, S, W, M)
    T = schedule.iterations
    to_next = [(i, (i + 1) % S) for i in range(S)]
    to_prev = [(i, (i - 1) % S) for i in range(S)]

    def device(w_Wx1xPxDxD, x_MxbxD):
        s = lax.axis_index("stage")
        w_WxPxDxD = w_Wx1xPxDxD[:, 0]
        b, D = x_MxbxD.shape[1:]
        zero = jnp.zeros((b, D), x_MxbxD.dtype)
        table = {k: jnp.asarray(v) for k, v in tab.items()}

        def iteration(carry, t):
            ring, fmail, bmail, inbox_f, inbox_b, grads, dx_in, loss = carry
            r = {k: v[t, s] for k, v in table.items()}
            put = lambda buf, i, on, val: lax.dynamic_update_index_in_dim(  # noqa: E731
                buf, jnp.where(on, val, buf[i]), i, 0)
            fmail = put(fmail, r["af_slot"], r["af_on"] == 1, inbox_f)
            bmail = put(bmail, r["ab_slot"], r["ab_on"] == 1, inbox_b)

            def forward(ring):
                x = jnp.where(r["f_first"] == 1, x_MxbxD[r["f_m"]], fmail[r["f_mail"]])
                ring = lax.dynamic_update_index_in_dim(ring, x, r["f_ring"], 0)
                y = lax.cond(r["f_last"] == 1, lambda: zero,  # its backward computes it
                             lambda: chunk(w_WxPxDxD[r["f_v"]], x))
                return ring, y

            ring, out_f = lax.cond(r["f_on"] == 1, forward, lambda ring: (ring, zero), ring)

            def backward(grads, dx_in, loss):
                y, vjp = jax.vjp(chunk, w_WxPxDxD[r["b_v"]], ring[r["b_ring"]])
                part, dy = jax.value_and_grad(micro_loss)(y, M)
                last = r["b_last"] == 1
                dw, dx = vjp(jnp.where(last, dy, bmail[r["b_mail"]]))
                grads = grads.at[r["b_v"]].add(dw)
                dx_in = put(dx_in, r["b_m"], r["b_first"] == 1, dx)
                return grads, dx_in, loss + jnp.where(last, part, 0.0), dx

            grads, dx_in, loss, out_b = lax.cond(
                r["b_on"] == 1, backward, lambda g, d, l: (g, d, l, zero), grads, dx_in, loss)
            carry = (ring, fmail, bmail, lax.ppermute(out_f, "stage", to_next),
                     lax.ppermute(out_b, "stage", to_prev), grads, dx_in, loss)
            return carry, None

        buf = lambda n: jnp.zeros((max(n, 1), b, D), x_MxbxD.dtype)  # noqa: E731
        carry = (buf(sizes["ring"]), buf(sizes["fmail"]), buf(sizes["bmail"]), zero, zero,
                 jnp.zeros_like(w_WxPxDxD), jnp.zeros_like(x_MxbxD), jnp.zeros((), jnp.float32))
        carry, _ = lax.scan(iteration, carry, jnp.arange(T))
        *_, grads, dx_in, loss = carry
        return lax.psum(loss, "stage"), grads[:, None], lax.psum(dx_in, "stage")

    run = jax.shard_map(device, mesh=mesh, in_specs=(P(None, "stage"), P()), check_vma=False,
                        out_specs=(P(), P(None, "stage"), P()))
    return jax.jit(run), schedule.held, sizes


def circular(mesh, S: int, W: int, M: int):
    """jaxmoe's schedule: stage s runs copy t - s (micro-batch mod M, round div M);
    autodiff of the loop, each chunk recomputed from its input."""
    to_next = [(i, (i + 1) % S) for i in range(S)]
    step = jax.checkpoint(chunk, policy=jax.checkpoint_policies.nothing_saveable)

    def device(w_Wx1xPxDxD, x_MxbxD):
        s = lax.axis_index("stage")
        w_WxPxDxD = w_Wx1xPxDxD[:, 0]

        def iteration(carry, t):
            inbox, store = carry
            arrived = t - S  # stage 0 files the last stage's output of copy t - S
            filed = jnp.where((s == 0) & (arrived >= 0), inbox,
                              lax.dynamic_index_in_dim(store, arrived % M, keepdims=False))
            store = lax.dynamic_update_index_in_dim(store, filed, arrived % M, 0)
            x = jnp.where(s == 0, lax.dynamic_index_in_dim(store, t % M, keepdims=False), inbox)
            copy = t - s
            valid = (copy >= 0) & (copy < W * M)
            out = step(w_WxPxDxD[jnp.clip(copy // M, 0, W - 1)], x)
            kept = jnp.where((s == S - 1) & valid, out,
                             lax.dynamic_index_in_dim(store, copy % M, keepdims=False))
            store = lax.dynamic_update_index_in_dim(store, kept, copy % M, 0)
            return (lax.ppermute(out, "stage", to_next), store), None

        (_, store), _ = lax.scan(iteration, (jnp.zeros_like(x_MxbxD[0]), x_MxbxD),
                                 jnp.arange(W * M + S - 1))
        losses = jax.vmap(micro_loss, in_axes=(0, None))(store, M)
        return lax.psum(jnp.where(s == S - 1, jnp.sum(losses), 0.0), "stage")

    run = jax.shard_map(device, mesh=mesh, in_specs=(P(None, "stage"), P()), out_specs=P(),
                        check_vma=False)
    return jax.jit(jax.value_and_grad(run, argnums=(0, 1)))


def temp_mb(fn, *args) -> float:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--virtual", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="*", default=[8, 16, 32])
    parser.add_argument("--rows", type=int, default=256, help="rows of a micro-batch")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--per", type=int, default=2, help="layers per chunk")
    args = parser.parse_args()
    S, W, D, b = args.stages, args.virtual, args.width, args.rows
    mesh = Mesh(np.array(jax.devices()[:S]), ("stage",))
    key_w, key_x = jax.random.split(jax.random.PRNGKey(0))
    w = jax.random.normal(key_w, (W, S, args.per, D, D)) / np.sqrt(D)
    mb = b * D * 4 / 1e6
    print(f"S={S} W={W}, chunks of {args.per} layers, micro-batch inputs {b} x {D} fp32 "
          f"({mb:.3f} MB); jax {jax.__version__}")
    print("| M | schedule | chunk inputs held | max diff: loss, weight grad, input grad | "
          "temp memory (one device) |")
    print("|---|---|---|---|---|")
    for M in args.microbatches:
        x = jax.random.normal(key_x, (M, b, D))
        loss, (gw, gx) = jax.jit(jax.value_and_grad(sequential, argnums=(0, 1)))(w, x)
        circ = circular(mesh, S, W, M)
        (c_loss, (c_gw, c_gx)) = circ(w, x)
        plan = fewest_held(S, W, M, 2.0)
        ofob, held, sizes = one_f_one_b(mesh, S, W, M, plan.held)
        o_loss, o_gw, o_gx = ofob(w, x)
        for name, (l_, gw_, gx_), fn, count in (
                ("circular (jaxmoe)", (c_loss, c_gw, c_gx), circ, M * W),
                (f"1F1B ({plan.iterations} iterations; mailboxes {sizes['fmail']}, "
                 f"{sizes['bmail']})", (o_loss, o_gw, o_gx), ofob, held)):
            diffs = [float(jnp.max(jnp.abs(a - r))) for a, r in
                     ((l_, loss), (gw_, gw), (gx_, gx))]
            print(f"| {M} | {name} | {count} ({count * mb:.2f} MB) | "
                  + ", ".join(f"{d:.1e}" for d in diffs) + f" | {temp_mb(fn, w, x):.2f} MB |")


if __name__ == "__main__":
    main()
