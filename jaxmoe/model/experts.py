"""Routed experts: SwiGLU weights stacked over experts, and the grouped GEMM."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config import MoEConfig
from jaxmoe.model.layers import param
from jaxmoe.model.remat import EXPERT_DOWN, EXPERT_GATE_UP
from jaxmoe.ops.grouped_gemm import grouped_matmul
from jaxmoe.ops.kernels import Kernels
from jaxmoe.ops.mx import MXWeight, mx_linear, quantize_weight
from jaxmoe.ops.mx_grouped import ALIGN, IMPLEMENTATIONS as MX_GROUPED, Options as MXOptions
from jaxmoe.ops.mx_grouped import aligned_ends, grouped_mx_linear


class ExpertWeights(NamedTuple):
    """Stacked expert weights; E may be the local slice of the experts under EP. Each is
    an array, or with MXFP8 experts the `MXWeight` holding its copies for the step."""

    w_gate_up_ExDx2F: jax.Array | MXWeight
    w_down_ExFxD: jax.Array | MXWeight


def expert_ffn(w: ExpertWeights, x_ExCxD: jax.Array, cfg: MoEConfig | None = None,
               kernels: Kernels | None = None) -> jax.Array:
    """Grouped GEMM over per-expert row buffers: SwiGLU of each expert on its rows.

    A batched matmul over equal-size buffers, which XLA compiles to plain GEMMs on
    every backend and which does the buffers' work only (`lax.ragged_dot` computes
    every group for every row on CPU and, as XLA:GPU lowers it, on GPU too). With
    `moe.expert_precision: mxfp8` both GEMMs take MXFP8 operands (see
    jaxmoe.ops.mx), in the target's native block-scaled GEMM where `kernels` has
    one (None: the default device's).
    """
    dt = x_ExCxD.dtype
    if cfg is not None and cfg.expert_precision == "mxfp8":
        kernels = Kernels.default() if kernels is None else kernels
        matmul = functools.partial(mx_linear, mxfp8_weight_grad=cfg.mxfp8_weight_grad,
                                   scale_rule=cfg.mxfp8_scale, native=kernels.native_mxfp8)
    else:
        matmul = lambda x, w: jnp.einsum("eck,ekn->ecn", x, w.astype(dt))  # noqa: E731
    return swiglu_experts(matmul, w, x_ExCxD)


def row_alignment(implementation: str) -> int:
    """The row each expert's packed rows must start at a multiple of, for the grouped
    GEMM `implementation` (`Kernels.grouped_gemm`): MXFP8's kernels take groups of whole
    256-row tiles; tokamax's, any rows."""
    return ALIGN if implementation in MX_GROUPED else 1


def expert_rows_ffn(w: ExpertWeights, x_ECxD: jax.Array, rows_E: jax.Array,
                    kernels: Kernels, implementation: str,
                    cfg: MoEConfig | None = None) -> jax.Array:
    """Each expert's SwiGLU on exactly its rows, packed expert after expert in `x_ECxD`
    (rows_E[e] rows each, from a multiple of `row_alignment` with zero rows up to it;
    the rows past the last are free and come back unspecified), as a grouped GEMM: the
    routed rows' work and no more. bf16 experts run `jaxmoe.ops.grouped_gemm`; MXFP8
    ones (`cfg.expert_precision`) `jaxmoe.ops.mx_grouped`, on the step's weight copies
    (`with_mx_copies`) or, outside a step, copies made here."""
    if implementation in MX_GROUPED:
        options = MXOptions(implementation, cfg.mxfp8_weight_grad, cfg.mxfp8_scale)
        ends_E = aligned_ends(rows_E)

        def matmul(x, w_ExIxO):
            if not isinstance(w_ExIxO, MXWeight):
                w_ExIxO = quantize_weight(w_ExIxO, cfg.mxfp8_scale)
            return grouped_mx_linear(x, w_ExIxO, ends_E, options, kernels)
    else:
        matmul = lambda x, w_ExIxO: grouped_matmul(x, w_ExIxO, rows_E, kernels,  # noqa: E731
                                                   implementation)
    return swiglu_experts(matmul, w, x_ECxD)


def swiglu_experts(matmul, w: ExpertWeights, x: jax.Array) -> jax.Array:
    """Each expert's SwiGLU on its rows of x, with `matmul(rows, stacked weights)` as
    the GEMM; both GEMM outputs are named for the remat policies (`train.remat`)."""
    with jax.named_scope("expert_gemms"):
        h = checkpoint_name(matmul(x, w.w_gate_up_ExDx2F), EXPERT_GATE_UP)
        gate, up = jnp.split(h, 2, axis=-1)
        return checkpoint_name(matmul(jax.nn.silu(gate) * up, w.w_down_ExFxD), EXPERT_DOWN)


class Experts(nnx.Module):
    def __init__(self, num_experts: int, d_model: int, hidden: int, std: float, out_std: float,
                 rngs: nnx.Rngs):
        E, D, F = num_experts, d_model, hidden
        self.w_gate_up = param(rngs, (E, D, 2 * F), ("experts", "embed", "expert_mlp"), std)
        self.w_down = param(rngs, (E, F, D), ("experts", "expert_mlp", "embed"), out_std)

    def weights(self) -> ExpertWeights:
        # get_value: a train step's working copy holds `MXWeight`s here (`with_mx_copies`)
        return ExpertWeights(self.w_gate_up.get_value(), self.w_down.get_value())
