"""An interleaved 1F1B pass as one SPMD program, against the circular schedule.

    python benchmarks/pipeline_1f1b.py [--stages 4] [--virtual 2] [--microbatches 8 16 32]

`jaxmoe.parallel.one_f_one_b.device_pass`, driven by `lockstep`'s tables, on a stack
of residual tanh layers (no attention, no routing) under `shard_map` over S fake
CPU devices. The circular schedule is jaxmoe's (`device_pipeline`'s order):
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
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from jaxmoe.parallel import lockstep  # noqa: E402
from jaxmoe.parallel.one_f_one_b import device_pass  # noqa: E402


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


def one_f_one_b(mesh, S: int, W: int, M: int):
    tables = lockstep.tables(lockstep.schedule(S, W, M))
    first = lambda x_MxbxD, m: (x_MxbxD[m], {})  # noqa: E731
    last = lambda x_MxbxD, y, m: (micro_loss(y, M), {})  # noqa: E731

    def device(w_Wx1xPxDxD, x_MxbxD):
        step = lambda w, x, m, v: (chunk(w, x), 0.0, {})  # noqa: E731
        loss, grads, dinputs, _ = device_pass(tables, first, step, last, w_Wx1xPxDxD[:, 0],
                                              x_MxbxD)
        return lax.psum(loss, "stage"), grads[:, None], lax.psum(dinputs, "stage")

    run = jax.shard_map(device, mesh=mesh, in_specs=(P(None, "stage"), P()),
                        out_specs=(P(), P(None, "stage"), P()))
    return jax.jit(run), tables


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

        init = jax.tree.map(lambda a: lax.pcast(a, ("stage",), to="varying"),
                            (jnp.zeros_like(x_MxbxD[0]), x_MxbxD))
        (_, store), _ = lax.scan(iteration, init, jnp.arange(W * M + S - 1))
        losses = jax.vmap(micro_loss, in_axes=(0, None))(store, M)
        return lax.psum(jnp.where(s == S - 1, jnp.sum(losses), 0.0), "stage")

    run = jax.shard_map(device, mesh=mesh, in_specs=(P(None, "stage"), P()), out_specs=P())
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
        ofob, tables = one_f_one_b(mesh, S, W, M)
        o_loss, o_gw, o_gx = ofob(w, x)
        ring, fmail, bmail = tables.sizes
        for name, (l_, gw_, gx_), fn, count in (
                ("circular (jaxmoe)", (c_loss, c_gw, c_gx), circ, M * W),
                (f"1F1B ({tables.f_on.shape[0]} iterations; mailboxes {fmail}, {bmail})",
                 (o_loss, o_gw, o_gx), ofob, ring)):
            diffs = [float(jnp.max(jnp.abs(a - r))) for a, r in
                     ((l_, loss), (gw_, gw), (gx_, gx))]
            print(f"| {M} | {name} | {count} ({count * mb:.2f} MB) | "
                  + ", ".join(f"{d:.1e}" for d in diffs) + f" | {temp_mb(fn, w, x):.2f} MB |")


if __name__ == "__main__":
    main()
