"""One device's share of an interleaved 1F1B pass: forward and backward in one loop.

`device_pass` runs inside a `shard_map` over the stage axis, driven by
`lockstep.tables`. Each iteration, a stage looks up its ops, and a `lax.cond` skips
the ones it does not run: a stage's collectives span only the devices of that
stage, so each stage branches on its own schedule. Where a forward runs, the stage
files the chunk's input in its ring and sends the chunk's output on. Where a
backward runs, it recomputes the chunk from that input under `jax.vjp` (the
`full` recomputation: the ring holds inputs only). It then sends the input's
cotangent back and adds the weights' cotangent into the round's gradient. The
model's last chunk computes its micro-batch's loss inside its backward, so that
chunk's forward only files its input. Activations and cotangents that arrive
before their op runs wait in mailboxes.

The loss is the sum of the last chunks' losses and every chunk's own part (router
losses: `chunk` returns them beside its output). Its gradients come out of the
loop, so no autodiff runs over it: a step differentiates the parts before and after
it with `jax.vjp` and chains them with this pass's.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxmoe.ops.vma import vary, varying_axes
from jaxmoe.parallel.lockstep import Tables


def device_pass(tables: Tables, chunk: Callable, last_loss: Callable, weights_W, inputs_M,
                axis: str = "stage"):
    """Returns (loss, grads_W, dinputs_M) of this stage.

    chunk(w, x, m, v) -> (y, part): round v's chunk (weights w, one leaf of each of
      `weights_W`'s leaves) over micro-batch m's activation x, y of x's shape and
      dtype; part is a scalar the chunk adds to the loss.
    last_loss(y, m) -> scalar: micro-batch m's loss from the model's last output.
    weights_W: this stage's chunks, leaves [W, ...].
    inputs_M: [M, ...] the pass's inputs (the first stage reads them).

    loss: this stage's share (its chunks' parts, and on the last stage the micro-
    batches' losses): summed over `axis` it is the pass's. grads_W: its weights'
    gradient, summed in their dtype, and varying over every axis the pass does (the
    caller reduces it once, as the ddp step does a gradient). dinputs_M: the inputs'
    gradient, on the first stage (zeros elsewhere).
    """
    s = lax.axis_index(axis)
    S = tables.f_on.shape[1]
    table = {k: jnp.asarray(v) for k, v in tables._asdict().items() if k != "sizes"}
    to_next = [(i, (i + 1) % S) for i in range(S)]
    to_prev = [(i, (i - 1) % S) for i in range(S)]
    # The carry varies over every axis its values may (check_vma holds a scan to it).
    # The weights are cast to vary over them too, once: a weight that did not would
    # have its cotangent summed over those axes in every backward, not once.
    axes = {axis, *varying_axes(inputs_M)}.union(*map(varying_axes, jax.tree.leaves(weights_W)))
    zero = vary(jnp.zeros_like(inputs_M[0]), axes)
    y, part = jax.eval_shape(lambda w, x: chunk(w, x, 0, 0),
                             jax.tree.map(lambda a: a[0], weights_W), zero)
    last = jax.eval_shape(last_loss, vary(zero, axes | varying_axes(y)), 0)
    axes |= varying_axes(y) | varying_axes(part) | varying_axes(last)
    loss_dtype = jnp.result_type(part.dtype, last.dtype)
    weights_W = jax.tree.map(lambda a: vary(a, axes), weights_W)
    pick = lambda v: jax.tree.map(lambda a: a[v], weights_W)  # noqa: E731
    zero = vary(zero, axes)

    def put(buf, i, on, value):  # writes buf[i] where `on`, without a select over buf
        return lax.dynamic_update_index_in_dim(buf, jnp.where(on, value, buf[i]), i, 0)

    def iteration(carry, t):
        ring, fmail, bmail, inbox_f, inbox_b, grads, dinputs, loss = carry
        r = {k: v[t, s] for k, v in table.items()}
        fmail = put(fmail, r["in_f_slot"], r["in_f"] == 1, inbox_f)
        bmail = put(bmail, r["in_b_slot"], r["in_b"] == 1, inbox_b)

        def forward(ring):
            x = jnp.where(r["f_first"] == 1, inputs_M[r["f_micro"]], fmail[r["f_mail"]])
            ring = lax.dynamic_update_index_in_dim(ring, x, r["f_ring"], 0)
            y = lax.cond(r["f_last"] == 1, lambda: zero,  # its backward computes it
                         lambda: chunk(pick(r["f_round"]), x, r["f_micro"], r["f_round"])[0])
            return ring, y

        ring, out_f = lax.cond(r["f_on"] == 1, forward, lambda ring: (ring, zero), ring)

        def backward(last: bool):
            def run(grads, dinputs, loss):
                m, v = r["b_micro"], r["b_round"]

                def through(w, x):
                    y, part = chunk(w, x, m, v)
                    return (part + last_loss(y, m),) if last else (y, part)

                out, vjp = jax.vjp(through, pick(v), ring[r["b_ring"]])
                ones = jnp.ones_like(out[-1])
                dw, dx = vjp((ones,) if last else (bmail[r["b_mail"]], ones))
                grads = jax.tree.map(lambda g, d: g.at[v].add(d.astype(g.dtype)), grads, dw)
                dinputs = put(dinputs, m, r["b_first"] == 1, dx)
                return grads, dinputs, loss + jnp.asarray(out[-1], loss.dtype), dx
            return run

        skip = lambda grads, dinputs, loss: (grads, dinputs, loss, zero)  # noqa: E731
        kind = r["b_on"] * (1 + r["b_last"])  # 0 none, 1 a chunk's, 2 the last chunk's
        grads, dinputs, loss, out_b = lax.switch(kind, [skip, backward(False), backward(True)],
                                                 grads, dinputs, loss)
        carry = (ring, fmail, bmail, lax.ppermute(out_f, axis, to_next),
                 lax.ppermute(out_b, axis, to_prev), grads, dinputs, loss)
        return carry, None

    slots = lambda n: vary(jnp.zeros((max(n, 1),) + zero.shape, zero.dtype), axes)  # noqa: E731
    ring_n, fmail_n, bmail_n = tables.sizes
    carry = (slots(ring_n), slots(fmail_n), slots(bmail_n), zero, zero,
             jax.tree.map(lambda w: vary(jnp.zeros_like(w), axes), weights_W),
             vary(jnp.zeros_like(inputs_M), axes), vary(jnp.zeros((), loss_dtype), axes))
    carry, _ = lax.scan(iteration, carry, jnp.arange(tables.f_on.shape[0]))
    *_, grads, dinputs, loss = carry
    return loss, grads, dinputs
