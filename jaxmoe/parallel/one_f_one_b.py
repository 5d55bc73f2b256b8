"""One device's share of an interleaved 1F1B pass: forward and backward in one loop.

`device_pass` runs inside a `shard_map` over the stage axis, driven by
`lockstep.tables`. Each iteration, a stage looks up its ops, and a `lax.cond` skips
the ones it does not run: a stage's collectives span only the devices of that
stage, so each stage branches on its own schedule. Where a forward runs, the stage
files the chunk's input in its ring and sends the chunk's output on. Where a
backward runs, it recomputes the chunk from that input under `jax.vjp` (the
`full` recomputation: the ring holds inputs only). It then sends the input's
cotangent back and adds the weights' cotangent into the round's gradient. Activations
and cotangents that arrive before their op runs wait in mailboxes.

The model's first chunk makes its micro-batch's input (`first`: the embedding and
the layers in front of the pipeline) and its backward differentiates that too; the
last chunk's backward computes the micro-batch's loss (`last`: the head, the loss),
so its forward only files its input. Both read the `outer` weights, whose gradient
the pass returns beside the chunks'. The loss is the sum of the last chunks' losses
and every chunk's own part (router losses: `chunk` returns them beside its output).
Its gradients come out of the loop, so no autodiff runs over it.

Each op's statistics (router loads, the losses' parts) come from its backward,
which every (micro-batch, chunk) runs once: the pass returns them per iteration,
zeros where the stage ran none, for the caller to total by the tables.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmoe.ops.vma import vary, varying_axes
from jaxmoe.parallel.lockstep import Tables


def branches(tables: Tables) -> dict[str, np.ndarray]:
    """Which branch each of the pass's conditionals takes at each (iteration, stage):
    a conditional runs under the named scope `branch_scope(name)`, so that a reader of
    the compiled program (the planner's walk) can price each iteration by the branches
    its stages take, where a stage's slowest branch every iteration would overcount.
    -1 where the conditional does not run (those inside a forward, where none runs)."""
    inside_forward = lambda a: np.where(tables.f_on == 1, a, -1).astype(np.int32)  # noqa: E731
    return {"f_on": tables.f_on, "f_first": inside_forward(tables.f_first),
            "f_not_last": inside_forward(tables.f_last == 0),
            # 0 none, 1 a chunk's, 2 the model's last chunk's, 3 its first chunk's
            "b_kind": tables.b_on * (1 + tables.b_last + 2 * tables.b_first)}


def branch_scope(name: str) -> str:
    return f"lockstep_branch={name}"


def device_pass(tables: Tables, first: Callable, chunk: Callable, last: Callable, weights_W,
                outer, axis: str = "stage", sums=None):
    """Returns (loss, grads_W, grads_outer, stats) of this stage.

    first(outer, m) -> (x, stats): micro-batch m's input to the model's first chunk.
    chunk(w, x, m, v) -> (y, part, stats): round v's chunk (weights w, one leaf of each
      of `weights_W`'s leaves) over micro-batch m's activation x, y of x's shape and
      dtype; part is a scalar the chunk adds to the loss.
    last(outer, y, m) -> (loss, stats): micro-batch m's loss from the model's last output.
    weights_W: this stage's chunks, leaves [W, ...]. outer: what `first` and `last` read.
    sums: zeros (grads_W, grads_outer) whose dtypes the gradients are summed in (None:
      each weight's own).

    loss: this stage's share (its chunks' parts, and on the last stage the micro-
    batches' losses): summed over `axis` it is the pass's. grads_W, grads_outer: the
    gradients, varying over every axis the pass does (the caller reduces them once,
    as the ddp step does). stats: (first's, chunk's, last's) stats at each iteration
    [T, ...], from the backward this stage ran there (zeros where it ran none).
    """
    if np.any((tables.b_first == 1) & (tables.b_last == 1)):
        raise ValueError("a 1F1B pass of one chunk: its first chunk is its last, which "
                         "needs no pipeline")
    s = lax.axis_index(axis)
    S = tables.f_on.shape[1]
    table = {k: jnp.asarray(v) for k, v in {**tables._asdict(), **branches(tables)}.items()
             if k != "sizes"}
    to_next = [(i, (i + 1) % S) for i in range(S)]
    to_prev = [(i, (i - 1) % S) for i in range(S)]
    # The carry varies over every axis its values may (check_vma holds a scan to it).
    # The weights are cast to vary over them too, once: a weight that did not would
    # have its cotangent summed over those axes in every backward, not once.
    axes = {axis}.union(*map(varying_axes, jax.tree.leaves((weights_W, outer))))

    def probe(weights_W, outer):  # the ops' outputs, for their shapes and varying axes
        x, first_stats = first(outer, 0)
        y, part, chunk_stats = chunk(jax.tree.map(lambda a: a[0], weights_W), vary(x, axes), 0, 0)
        loss, last_stats = last(outer, vary(y, axes), 0)
        return x, y, part, loss, (first_stats, chunk_stats, last_stats)

    varied = lambda tree: jax.tree.map(lambda a: vary(a, axes), tree)  # noqa: E731
    x, y, part, loss_out, stats_like = jax.eval_shape(probe, *varied((weights_W, outer)))
    axes |= set().union(*map(varying_axes, jax.tree.leaves((x, y, part, loss_out, stats_like))))
    loss_dtype = jnp.result_type(part.dtype, loss_out.dtype)
    weights_W, outer = varied((weights_W, outer))
    pick = lambda v: jax.tree.map(lambda a: a[v], weights_W)  # noqa: E731
    zeros = lambda like: jax.tree.map(  # noqa: E731
        lambda a: vary(jnp.zeros(a.shape, a.dtype), axes), like)
    zero = zeros(x)
    no_stats = zeros(stats_like)

    def put(buf, i, on, value):  # writes buf[i] where `on`, without a select over buf
        return lax.dynamic_update_index_in_dim(buf, jnp.where(on, value, buf[i]), i, 0)

    def iteration(carry, t):
        ring, fmail, bmail, inbox_f, inbox_b, grads, grads_outer, loss = carry
        r = {k: v[t, s] for k, v in table.items()}
        fmail = put(fmail, r["in_f_slot"], r["in_f"] == 1, inbox_f)
        bmail = put(bmail, r["in_b_slot"], r["in_b"] == 1, inbox_b)

        def forward(ring):
            with jax.named_scope(branch_scope("f_first")):
                x = lax.cond(r["f_first"] == 1, lambda: varied(first(outer, r["f_micro"])[0]),
                             lambda: fmail[r["f_mail"]])
            ring = lax.dynamic_update_index_in_dim(ring, x, r["f_ring"], 0)
            with jax.named_scope(branch_scope("f_not_last")):  # the last's backward computes it
                y = lax.cond(r["f_last"] == 0, lambda: varied(chunk(
                    pick(r["f_round"]), x, r["f_micro"], r["f_round"])[0]), lambda: zero)
            return ring, y

        with jax.named_scope(branch_scope("f_on")):
            ring, out_f = lax.cond(r["f_on"] == 1, forward, lambda ring: (ring, zero), ring)

        def backward(kind: str):  # "chunk", "last" (the model's last) or "first"
            def run(grads, grads_outer, loss):
                m, v = r["b_micro"], r["b_round"]

                def through(w, o, x):  # the first chunk makes its input again from `first`
                    first_stats, last_stats = no_stats[0], no_stats[2]
                    if kind == "first":
                        x, first_stats = first(o, m)
                    y, part, chunk_stats = chunk(w, x, m, v)
                    stats = lambda: (first_stats, chunk_stats, last_stats)  # noqa: E731
                    if kind == "last":
                        loss, last_stats = last(o, y, m)
                        return (part + loss,), stats()
                    return (y, part), stats()

                out, vjp, stats = jax.vjp(through, pick(v), outer if kind != "chunk" else {},
                                          ring[r["b_ring"]], has_aux=True)
                ones = jnp.ones_like(out[-1])
                dw, do, dx = vjp((ones,) if kind == "last" else (bmail[r["b_mail"]], ones))
                grads = jax.tree.map(lambda g, d: g.at[v].add(d.astype(g.dtype)), grads, dw)
                if kind != "chunk":
                    grads_outer = jax.tree.map(lambda g, d: g + d.astype(g.dtype), grads_outer,
                                               do)
                loss = loss + jnp.asarray(out[-1], loss.dtype)
                return grads, grads_outer, loss, varied(dx), varied(stats)
            return run

        def skip(grads, grads_outer, loss):
            return grads, grads_outer, loss, zero, no_stats

        with jax.named_scope(branch_scope("b_kind")):
            grads, grads_outer, loss, out_b, stats = lax.switch(
                r["b_kind"], [skip, backward("chunk"), backward("last"), backward("first")],
                grads, grads_outer, loss)
        carry = (ring, fmail, bmail, lax.ppermute(out_f, axis, to_next),
                 lax.ppermute(out_b, axis, to_prev), grads, grads_outer, loss)
        return carry, stats

    slots = lambda n: vary(jnp.zeros((max(n, 1),) + zero.shape, zero.dtype), axes)  # noqa: E731
    grads_W, grads_outer = zeros((weights_W, outer) if sums is None else sums)
    ring_n, fmail_n, bmail_n = tables.sizes
    carry = (slots(ring_n), slots(fmail_n), slots(bmail_n), zero, zero, grads_W, grads_outer,
             vary(jnp.zeros((), loss_dtype), axes))
    carry, stats = lax.scan(iteration, carry, jnp.arange(tables.f_on.shape[0]))
    *_, grads, grads_outer, loss = carry
    return loss, grads, grads_outer, stats
