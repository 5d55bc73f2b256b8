"""Context parallelism: each sequence split into chunks of positions over `context`.

Every device of a `context` group holds the same rows, a contiguous chunk of
seq_len / context positions each. Everything but attention acts on a position
alone (embedding, norms, MLPs, the router and experts, the loss), so a chunk is
just more tokens: the MoE layers route it as further batch rows through the
device's own expert group (experts are replicated over `context` as over `data`,
and ddp reduces their gradients over both).

Attention is the one place positions meet: before it, an all-to-all over
`context` trades sequence for heads (Ulysses), so each device holds every
position of num_heads / context heads and runs ordinary causal attention over
the whole sequence, cuDNN's fused kernel included; a second all-to-all brings
its output back. Causal
work is even by construction: every device computes the full causal triangle
of its heads, so no zig-zag reordering of chunks is needed.

Chosen over gathering every chunk's K and V to every device (Llama 3's way) and
over a ring of K/V blocks (`ppermute`): those run a chunk of queries against a
longer key sequence, which needs a causal mask aligned at the bottom right (JAX's
cuDNN binding aligns it at the top left) or a merge of partial softmaxes, and a
zig-zag split to balance the causal work. Bytes per layer and device, forward,
with H query heads, G K/V heads, Hd the head size, L positions, c devices: the
all-to-alls send (2H + 2G) Hd (L / c) (c - 1) / c, the gather or ring brings in
2G Hd (L / c) (c - 1): fewer for the all-to-alls once c > H / G + 1
(`olmoe_8layer_e128`, H / G = 4, at c = 8: 8.75 Hd L against 14 Hd L). The gather also holds the whole sequence's K/V
on every device, where the all-to-alls hold L / c positions' worth of every head.
The price: num_heads must split over `context`, and K/V heads fewer than the
devices are repeated to one per device first (their query heads follow them).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

AXIS = "context"


def chunk_offset(length: int) -> jax.Array:
    """The first position of this device's chunk, of `length` positions."""
    return lax.axis_index(AXIS) * length


def own_chunk(rows_BxN: jax.Array, length: int, extra: int = 0) -> jax.Array:
    """This device's `length` positions of each row (plus `extra` after them: a row of
    tokens holds one more than its inputs, the last input's target)."""
    return lax.dynamic_slice_in_dim(rows_BxN, chunk_offset(length), length + extra, axis=1)


def _sequence_to_heads(x: jax.Array) -> jax.Array:
    """[B, L, H, Hd] (a chunk of L positions, every head) -> [B, c L, H / c, Hd] (every
    position of the sequences, this device's heads)."""
    return lax.all_to_all(x, AXIS, split_axis=2, concat_axis=1, tiled=True)


def _heads_to_sequence(x: jax.Array) -> jax.Array:
    """`_sequence_to_heads` undone."""
    return lax.all_to_all(x, AXIS, split_axis=1, concat_axis=2, tiled=True)


def attend_across(attend: Callable, q_BxLxHxHd, k_BxLxGxHd, v_BxLxGxHd,
                  context: int) -> jax.Array:
    """attend(q, k, v) (causal over whole sequences) on a device's chunk of L positions:
    heads for sequence there and back. K/V heads fewer than `context` are repeated to
    one per device, in order, so that device i's query heads (the i-th of `context`
    blocks) meet the K/V head they were grouped with. An attend that also returns a
    per-head value [H / c] (`attention.max_logits`) has it gathered to every head's, [H]."""
    G = k_BxLxGxHd.shape[2]
    if G < context:
        k_BxLxGxHd, v_BxLxGxHd = (jnp.repeat(a, context // G, axis=2)
                                  for a in (k_BxLxGxHd, v_BxLxGxHd))
    q, k, v = map(_sequence_to_heads, (q_BxLxHxHd, k_BxLxGxHd, v_BxLxGxHd))
    out = attend(q, k, v)
    if isinstance(out, tuple):
        o, per_head = out
        return _heads_to_sequence(o), lax.all_gather(per_head, AXIS, axis=0, tiled=True)
    return _heads_to_sequence(out)
