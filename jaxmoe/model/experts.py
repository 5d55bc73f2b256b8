"""Routed experts: SwiGLU weights stacked over experts, and the grouped GEMM."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.model.layers import param


class ExpertWeights(NamedTuple):
    """Stacked expert weights; E may be the local slice of the experts under EP."""

    w_gate_up_ExDx2F: jax.Array
    w_down_ExFxD: jax.Array


def expert_ffn(w: ExpertWeights, x_ExCxD: jax.Array) -> jax.Array:
    """Grouped GEMM over per-expert row buffers: SwiGLU of each expert on its rows.

    A batched matmul over equal-size buffers: on CPU this beats ragged_dot, which
    computes every group densely there. The backward is written out (see
    `_matmul_nt`) to choose which operand of each input-gradient matmul is transposed.
    """
    return _expert_ffn(w, x_ExCxD)


def _swiglu_fwd(w: ExpertWeights, x_ExCxD: jax.Array):
    h_ExCx2F = jnp.einsum("ecd,edf->ecf", x_ExCxD, w.w_gate_up_ExDx2F.astype(x_ExCxD.dtype))
    gate, up = jnp.split(h_ExCx2F, 2, axis=-1)
    y_ExCxD = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up,
                         w.w_down_ExFxD.astype(x_ExCxD.dtype))
    return y_ExCxD, h_ExCx2F


@jax.custom_vjp
def _expert_ffn(w: ExpertWeights, x_ExCxD: jax.Array) -> jax.Array:
    return _swiglu_fwd(w, x_ExCxD)[0]


def _expert_ffn_fwd(w, x_ExCxD):
    y_ExCxD, h_ExCx2F = _swiglu_fwd(w, x_ExCxD)
    return y_ExCxD, (w, x_ExCxD, h_ExCx2F)


def _expert_ffn_bwd(res, dy_ExCxD):
    w, x_ExCxD, h_ExCx2F = res
    dt = x_ExCxD.dtype
    gate, up = jnp.split(h_ExCx2F, 2, axis=-1)
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    da_ExCxF = _matmul_nt(dy_ExCxD, w.w_down_ExFxD.astype(dt))
    dw_down = jnp.einsum("ecf,ecd->efd", silu * up, dy_ExCxD)
    dh_ExCx2F = jnp.concatenate([da_ExCxF * up * sig * (1 + gate * (1 - sig)), da_ExCxF * silu],
                                axis=-1)
    dw_gate_up = jnp.einsum("ecd,ecf->edf", x_ExCxD, dh_ExCx2F)
    dx_ExCxD = _matmul_nt(dh_ExCx2F, w.w_gate_up_ExDx2F.astype(dt))
    dw = ExpertWeights(dw_gate_up, dw_down)
    return jax.tree.map(_cotangent_like, (dw, dx_ExCxD), (w, x_ExCxD))


def _cotangent_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """Casts to the primal's dtype and, inside shard_map, sums over the mesh axes the
    cotangent varies along but the primal does not (what autodiff's pvary transpose does)."""
    extra = tuple(sorted(_varying(ct) - _varying(primal)))
    ct = jax.lax.psum(ct, extra) if extra else ct
    return ct.astype(primal.dtype)


def _varying(a: jax.Array) -> frozenset:
    return jax.typeof(a).manual_axis_type.varying


_expert_ffn.defvjp(_expert_ffn_fwd, _expert_ffn_bwd)


def _matmul_nt(a_ExCxN: jax.Array, w_ExMxN: jax.Array) -> jax.Array:
    """a @ w^T per expert, [E, C, M].

    XLA:CPU's GEMM (YNNPACK) re-lays out a transposed right-hand operand on every
    call. With few rows per expert (C <= M / 4, e.g. 128 rows at E=128) that
    operand should be the rows, not the weights: compute (w @ a^T)^T instead; the
    barrier keeps XLA from folding the transpose back into the dot. (Measured:
    a few % faster at E=128; at C = M / 2 it was slower, hence the margin.)
    """
    if 4 * a_ExCxN.shape[1] > w_ExMxN.shape[1]:
        return jnp.einsum("ecn,emn->ecm", a_ExCxN, w_ExMxN)
    out_ExMxC = jax.lax.dot_general(w_ExMxN, a_ExCxN, (((2,), (2,)), ((0,), (0,))))
    return jnp.swapaxes(jax.lax.optimization_barrier(out_ExMxC), 1, 2)


class Experts(nnx.Module):
    def __init__(self, num_experts: int, d_model: int, hidden: int, std: float, out_std: float,
                 rngs: nnx.Rngs):
        E, D, F = num_experts, d_model, hidden
        self.w_gate_up = param(rngs, (E, D, 2 * F), ("experts", "embed", "expert_mlp"), std)
        self.w_down = param(rngs, (E, F, D), ("experts", "expert_mlp", "embed"), out_std)

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self.w_gate_up[...], self.w_down[...])
