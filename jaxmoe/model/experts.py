"""Routed experts: SwiGLU weights stacked over experts, and the grouped GEMM."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config import MoEConfig
from jaxmoe.kernels import Kernels
from jaxmoe.model.layers import param
from jaxmoe.model.remat import EXPERT_DOWN, EXPERT_GATE_UP
from jaxmoe.ops.mx import mx_linear


class ExpertWeights(NamedTuple):
    """Stacked expert weights; E may be the local slice of the experts under EP."""

    w_gate_up_ExDx2F: jax.Array
    w_down_ExFxD: jax.Array


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
        return ExpertWeights(self.w_gate_up[...], self.w_down[...])
