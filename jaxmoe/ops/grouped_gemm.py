"""A grouped GEMM over exactly the rows each expert received: tokamax's ragged dot.

Rows come packed, expert after expert ([C, I], the first `rows_E[0]` rows are
expert 0's, and so on; the rows past their sum are free space): the kernel
computes each group's rows against its weight and nothing past them, forward,
input gradient and weight gradient alike (the gradients are ragged dots too).
XLA's own `lax.ragged_dot` is no substitute on GPU: XLA:GPU lowers it to a dense
dot over every group (`benchmarks/ragged_dot_gpu.py`), E times the work.

The implementations (`Kernels.grouped_gemm` picks one from the devices):

- "triton": tokamax's Triton kernel, called through jax-triton, on every NVIDIA GPU:
  one program per group and tile of rows, so a group's rows are computed in whole
  tiles from its start and nothing past them;
- "mosaic": tokamax's Pallas Mosaic GPU kernel (warp-specialized, Hopper on), kept
  but not chosen: inside the train step's `shard_map` its Blackwell kernel fails
  JAX's mesh-axis type check when traced (`benchmarks/RESULTS.md`, "jaxmoe on jax
  0.12"), and one choice for every GPU keeps one program to test;
- "xla": tokamax's reference (`lax.ragged_dot`), which checks the packed layouts
  on CPU; it computes every group for every row.

Tokamax picks tiles from the device it is traced for, which it reads as JAX's
default device; a program compiled for a GPU on a host without one
(`jaxmoe.plan.targets`) is traced with the target's virtual device as default.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil

import jax
import jax.numpy as jnp
from jax import lax

from jaxmoe.ops.kernels import Kernels
from jaxmoe.ops.vma import varying_axes, vary

IMPLEMENTATIONS = ("mosaic", "triton", "xla")
_CUDA_PTXAS = "/usr/local/cuda/bin/ptxas"  # where jaxlib looks when PATH has none
# forward [C, I] x [E, I, O]; input gradient [C, O] x [E, I, O] (O contracted); weight
# gradient [C, I] x [C, O] -> [E, I, O] (the ragged C contracted, expert by expert)
_FORWARD = lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,))
_INPUT_GRAD = lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,))
_WEIGHT_GRAD = lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())


def grouped_matmul(x_CxI: jax.Array, w_ExIxO: jax.Array, rows_E: jax.Array,
                   kernels: Kernels, implementation: str) -> jax.Array:
    """[C, O]: row block e of `x_CxI` (rows_E[e] rows, packed in order) times
    w_ExIxO[e]; rows past sum(rows_E) are left unspecified (the kernels skip them).

    Inside a `shard_map` the kernels' results carry no mesh axes on their types, so
    both operands are first typed as varying over the axes either varies over (the
    weight's gradient is summed over the others by that cast's transpose, as for a
    plain dot) and every result is typed the same."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"grouped GEMM: {implementation!r} is not one of {IMPLEMENTATIONS}")
    axes = varying_axes(x_CxI) | varying_axes(w_ExIxO)
    x_CxI, w_ExIxO = vary(x_CxI, axes), vary(w_ExIxO.astype(x_CxI.dtype), axes)
    return _grouped(x_CxI, w_ExIxO, rows_E, kernels, implementation)


def grouped_weight_grad(x_CxI: jax.Array, dy_CxO: jax.Array, rows_E: jax.Array,
                        kernels: Kernels, implementation: str,
                        dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """[E, I, O] in `dtype`: each expert's rows of x (rows_E[e], packed in order)
    transposed times the same rows of dy: `grouped_matmul`'s weight gradient, for a
    caller with its own forward (`jaxmoe.ops.mx_grouped`). The kernel sums in fp32
    and rounds once, as it stores."""
    axes = varying_axes(x_CxI) | varying_axes(dy_CxO)
    like = vary(jnp.zeros((), dtype), axes)
    return _ragged_dot(vary(x_CxI, axes), vary(dy_CxO, axes), rows_E, _WEIGHT_GRAD, kernels,
                       implementation, like)


def _no_tuning_notice(record: logging.LogRecord) -> bool:
    """Drops tokamax's warning, once per shape, that it has no tuned tiles for a shape
    and uses its heuristics' (what every shape outside its shipped cache gets)."""
    return not str(record.msg).startswith("Autotuning cache miss")


def _ragged_dot(lhs, rhs, rows_E, numbers, kernels: Kernels, implementation: str, like):
    try:
        import tokamax
    except ImportError as e:
        raise RuntimeError("the grouped expert GEMM needs tokamax: pip install -e \".[cuda]\" "
                           "(or the gpu-compile extra, to compile for a GPU without one)") from e
    absl = logging.getLogger("absl")
    if _no_tuning_notice not in absl.filters:
        absl.addFilter(_no_tuning_notice)
    if implementation == "triton":
        _triton_writes_for_the_assembler()
    traced_for = (jax.default_device(kernels.device) if kernels.device is not None
                  and implementation != "xla" else contextlib.nullcontext())
    with traced_for:
        out = tokamax.ragged_dot_general(lhs, rhs, rows_E, numbers,
                                         preferred_element_type=like.dtype,
                                         implementation=implementation)
    return vary(out, varying_axes(like))


def _triton_writes_for_the_assembler() -> None:
    """Makes Triton write PTX that the ptxas assembling it reads. Triton writes the
    newest PTX its own bundled ptxas takes (Triton 3.8's Blackwell ptxas is CUDA 13.3's:
    PTX 9.3), but jaxlib assembles a jax-triton kernel with the first ptxas on PATH, else
    a CUDA install's (/usr/local/cuda): an older one (CUDA 13.0's takes 9.0) rejects the
    kernel, and the B200/B300 program fails to compile. Triton's own variables, where the
    caller set them, win."""
    ptxas = shutil.which("ptxas") or (_CUDA_PTXAS if os.access(_CUDA_PTXAS, os.X_OK) else None)
    if ptxas is not None:
        for variable in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"):
            os.environ.setdefault(variable, ptxas)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x_CxI, w_ExIxO, rows_E, kernels, implementation):
    return _ragged_dot(x_CxI, w_ExIxO, rows_E, _FORWARD, kernels, implementation, x_CxI)


def _grouped_fwd(x_CxI, w_ExIxO, rows_E, kernels, implementation):
    return _grouped(x_CxI, w_ExIxO, rows_E, kernels, implementation), (x_CxI, w_ExIxO, rows_E)


def _grouped_bwd(kernels, implementation, residuals, dy_CxO):
    x_CxI, w_ExIxO, rows_E = residuals
    dx_CxI = _ragged_dot(dy_CxO, w_ExIxO, rows_E, _INPUT_GRAD, kernels, implementation, x_CxI)
    dw_ExIxO = _ragged_dot(x_CxI, dy_CxO, rows_E, _WEIGHT_GRAD, kernels, implementation,
                           w_ExIxO)
    return dx_CxI, dw_ExIxO, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
