"""Token dispatch: moving routed token copies to their experts and back.

The local dispatchers share one signature,

    dispatcher(x_TxD, routing, weights, cfg, kernels) -> Dispatched(y_TxD, dropped)

so the router and the experts never change when one is added (`kernels`: what
the target runs, `jaxmoe.ops.kernels`; None: the default device's). `dense` (every expert on every token) is the
reference; `grouped` packs the copies into fixed per-expert buffers for a batched
GEMM. The expert-parallel dispatchers (`jaxmoe.parallel.ep_dispatch`) share the
signature; the layout the model runs in chooses one by name (`Layout.dispatch`).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.model.experts import ExpertWeights, expert_ffn, expert_rows_ffn, row_alignment
from jaxmoe.model.router import Routing
from jaxmoe.ops.kernels import Kernels
from jaxmoe.ops.mx_grouped import aligned_rows, padded_groups


class Dispatched(NamedTuple):
    y_TxD: jax.Array  # combined expert outputs, weighted by the gates
    dropped: jax.Array  # int32: token copies that found no room (0 when dropless)


Dispatcher = Callable[[jax.Array, Routing, ExpertWeights, MoEConfig, Kernels], Dispatched]


def capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Rows per expert buffer: factor x the uniform share, at most every token."""
    return max(1, min(num_tokens, math.ceil(factor * num_tokens * top_k / num_experts)))


def routed_copies(expert_TxK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(expert_N, token_N) of the T * K routed copies, k-major: every token's first
    choice ranks before any second choice, so drops fall on lower choices first."""
    T, K = expert_TxK.shape
    return expert_TxK.T.reshape(-1), jnp.tile(jnp.arange(T, dtype=jnp.int32), K)


def _arrival_rows(expert_N: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(row_N, counts_E): each copy's place among its expert's copies, in arrival
    order, and the copies per expert."""
    N = expert_N.shape[0]
    order_N = jnp.argsort(expert_N, stable=True)
    counts_E = jnp.zeros((num_experts,), jnp.int32).at[expert_N].add(1)
    starts_E = jnp.cumsum(counts_E) - counts_E
    row_sorted_N = jnp.arange(N, dtype=jnp.int32) - starts_E[expert_N[order_N]]
    return jnp.zeros((N,), jnp.int32).at[order_N].set(row_sorted_N), counts_E


def buffer_slots(expert_N: jax.Array, num_experts: int, cap: int) -> tuple[jax.Array, jax.Array]:
    """Row-wise placement: each copy's row in its expert's buffer, in arrival order.

    Returns (slot_N, kept_N): slot = expert * cap + row for kept copies, and the
    out-of-range slot E * cap for copies past the capacity.
    """
    row_N, _ = _arrival_rows(expert_N, num_experts)
    kept_N = row_N < cap
    return jnp.where(kept_N, expert_N * cap + row_N, num_experts * cap), kept_N


def packed_rows_count(num_experts: int, cap: int, align: int = 1,
                      copies: int | None = None) -> int:
    """Rows of the buffers packed for a grouped GEMM: E * cap, or with each expert's rows
    starting at a multiple of `align` (`jaxmoe.ops.mx_grouped`), room for the kept
    copies (at most `copies`) and every group's padding."""
    if align == 1:
        return num_experts * cap
    kept = num_experts * cap if copies is None else min(copies, num_experts * cap)
    return aligned_rows(kept, num_experts, align)


def packed_slots(expert_N: jax.Array, num_experts: int, cap: int,
                 align: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`buffer_slots`' placement and drops with the buffers packed for a grouped GEMM:
    expert e's kept rows follow those of the experts before it, from a multiple of
    `align`. Returns (slot_N, kept_N, rows_E): rows_E[e] kept copies of expert e;
    slot `packed_rows_count` (past the buffers) for the dropped."""
    row_N, counts_E = _arrival_rows(expert_N, num_experts)
    rows_E = jnp.minimum(counts_E, cap)
    kept_N = row_N < cap
    padded_E = padded_groups(rows_E, align)
    start_E = jnp.cumsum(padded_E) - padded_E
    past = packed_rows_count(num_experts, cap, align, expert_N.shape[0])
    return jnp.where(kept_N, start_E[expert_N] + row_N, past), kept_N, rows_E


def gather_rows(x_TxD: jax.Array, slot_N: jax.Array, token_N: jax.Array, num_slots: int) -> jax.Array:
    """Fills `num_slots` buffer rows by gathering through the inverse map slot -> token.

    A gather (with scatter-add as its gradient) is cheaper on CPU than scattering
    D-wide rows; empty rows read a zero row.
    """
    T = x_TxD.shape[0]
    token_of_slot = jnp.full((num_slots + 1,), T, jnp.int32).at[slot_N].set(token_N)[:num_slots]
    x_pad = jnp.concatenate([x_TxD, jnp.zeros((1, x_TxD.shape[1]), x_TxD.dtype)])
    return x_pad[token_of_slot]


def combine_rows(y_ECxD: jax.Array, slot_N: jax.Array, gate_KxT: jax.Array) -> jax.Array:
    """Weighted sum over each token's K copies; dropped copies (slot E C, past
    the buffers' rows) add zero.

    The sum over K is elementwise rather than a K-deep matmul.
    """
    K, T = gate_KxT.shape
    y_pad = jnp.concatenate([y_ECxD, jnp.zeros((1, y_ECxD.shape[1]), y_ECxD.dtype)])
    y_KxTxD = y_pad[slot_N].reshape(K, T, -1)
    return jnp.sum(y_KxTxD * gate_KxT.astype(y_ECxD.dtype)[:, :, None], axis=0)


def dense_dispatch(x_TxD, routing: Routing, w: ExpertWeights, cfg: MoEConfig,
                   kernels: Kernels | None = None) -> Dispatched:
    """Reference: every expert on every token, weighted by the (mostly zero) gates."""
    T, E = x_TxD.shape[0], cfg.num_experts
    gates_TxE = jnp.zeros((T, E), jnp.float32).at[
        jnp.arange(T)[:, None], routing.expert_TxK].add(routing.gate_TxK)
    y_ExTxD = expert_ffn(w, jnp.broadcast_to(x_TxD, (E,) + x_TxD.shape), cfg, kernels)
    y_TxD = jnp.einsum("etd,te->td", y_ExTxD, gates_TxE.astype(x_TxD.dtype))
    return Dispatched(y_TxD, jnp.zeros((), jnp.int32))


def grouped_dispatch(x_TxD, routing: Routing, w: ExpertWeights, cfg: MoEConfig,
                     kernels: Kernels | None = None) -> Dispatched:
    """Local capacity-bounded dispatch: per-expert buffers and one batched GEMM, or
    where the devices have a grouped GEMM (`Kernels.grouped_gemm`), the same buffers
    packed and the GEMM over exactly the kept rows.

    Copies arrive k-major (`routed_copies`), so drops fall on lower choices first.
    """
    T, D = x_TxD.shape
    E, K = cfg.num_experts, cfg.top_k
    C = capacity(T, K, E, cfg.capacity_factor)
    expert_N, token_N = routed_copies(routing.expert_TxK)
    kernels = Kernels.default() if kernels is None else kernels
    if grouped := kernels.grouped_gemm(cfg, D):
        align = row_alignment(grouped)
        slot_N, kept_N, rows_E = packed_slots(expert_N, E, C, align)
        rows = packed_rows_count(E, C, align, expert_N.shape[0])
        x_ECxD = gather_rows(x_TxD, slot_N, token_N, rows)
        y_ECxD = expert_rows_ffn(w, x_ECxD, rows_E, kernels, grouped, cfg)
    else:
        slot_N, kept_N = buffer_slots(expert_N, E, C)
        x_ExCxD = gather_rows(x_TxD, slot_N, token_N, E * C).reshape(E, C, D)
        y_ECxD = expert_ffn(w, x_ExCxD, cfg, kernels).reshape(E * C, D)
    y_TxD = combine_rows(y_ECxD, slot_N, routing.gate_TxK.T)
    return Dispatched(y_TxD, jnp.sum(~kept_N).astype(jnp.int32))


# by name; a layout chooses among these and the expert-parallel ones
LOCAL = {"dense": dense_dispatch, "grouped": grouped_dispatch}
