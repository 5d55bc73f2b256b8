"""The routed experts' GEMMs in MXFP8 on exactly their rows: forward, input gradient and
weight gradient as block-scaled grouped GEMMs under one custom VJP.

Rows come packed expert after expert, each expert's first row at a multiple of `ALIGN`
(256) rows: group e is rows [ends[e-1], ends[e]), its routed copies first and zero rows
after them; `ends`, cumulative int32 (`aligned_ends`), is what the kernels take
(multiples of 256 for the forward and the input gradient, of 128 for the weight
gradient, whose 32-row scale blocks so never straddle two experts). The padding rows
must be zero: the weight gradient sums over every row of a group. Rows past ends[-1]
are free; the kernels skip them and their outputs are unspecified.

Every operand is MXFP8 along the axis its GEMM contracts (`jaxmoe.ops.mx`): x and the
weight along I in the forward; the output gradient and the weight along O in the input
gradient (`MXWeight.dgrad`, [E, I, O] blocked along O, is the kernel's k-major operand
as it is); x and the output gradient along the rows in the weight gradient with
`moe.mxfp8_weight_grad`, else bf16 operands (on GPU tokamax's grouped GEMM of
`jaxmoe.ops.grouped_gemm`, which reads x as it lies), fp32 accumulation throughout. The
kernels read the scales packed in 128 x 4 atoms (`pack_scales`; the weight gradient's
expert by expert, `pack_row_scales`).

Implementations:
- "cudnn": cuDNN's grouped block-scaled GEMMs, on Blackwell (`jaxmoe.ops.cudnn_grouped`);
- "reference": the kernels' contract in XLA, read from the same packed operands
  (dequantise, then a grouped GEMM accumulating in fp32): what runs where the kernels
  do not (CPU), and what the tests hold the packing to.

The kernels have no batching rule: a caller runs them on one device's rows (the ddp
step's `shard_map`, whose pipeline runs each device's own stage), never under `vmap`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxmoe.ops.grouped_gemm import grouped_weight_grad
from jaxmoe.ops.kernels import Kernels
from jaxmoe.ops.mx import BLOCK, MXWeight, ScaleRule, dequantize, like_primal, quantize
from jaxmoe.ops.vma import vary, varying_axes

ALIGN = 256  # rows per group are a multiple of this (the forward's and input gradient's)
# names a grouped GEMM of another library run on these aligned groups, whose buffer holds
# `aligned_rows`' room for padding (`jaxmoe.plan.program_flops` takes it off)
ALIGNED_SCOPE = "aligned_groups"
IMPLEMENTATIONS = ("cudnn", "reference")
_ATOM_ROWS, _ATOM_COLUMNS = 128, 4  # scales per atom: 128 rows x 4 blocks of 32
_PAD_SCALE = 127  # e8m0 2^0 in the atoms' padding: finite (0xFF is NaN), read by nothing


def padded_groups(rows: jax.Array, align: int = ALIGN) -> jax.Array:
    """Each group's rows rounded up to a multiple of `align` (an empty group stays empty)."""
    return (rows.astype(jnp.int32) + align - 1) // align * align


def aligned_ends(rows_E: jax.Array, align: int = ALIGN) -> jax.Array:
    """int32 [E]: the cumulative group ends of experts holding rows_E routed rows each,
    every group padded to a multiple of `align` rows (`padded_groups`)."""
    return jnp.cumsum(padded_groups(rows_E, align)).astype(jnp.int32)


def aligned_rows(routed: int, num_experts: int, align: int = ALIGN) -> int:
    """Rows of a packed buffer that holds any `routed` rows over `num_experts` groups,
    each padded to `align` (fewer than `align` padding rows a group): `routed` rounded
    up to `align`, and `align` more per group, so that a reader of the buffer's shape
    knows `routed` to within a group (`jaxmoe.plan.program_flops`)."""
    return -(-routed // align) * align + num_experts * align


# ---------------------------------------------------------------- scale packing


def pack_scales(s_xRxJ: jax.Array) -> jax.Array:
    """Scales [..., R, J] (J blocks of 32 along the contracted axis) in the kernels'
    atoms, [..., R/128, J/4, 32, 4, 4]: atom (rt, jt) holds rows rt*128 .. +127 and blocks
    jt*4 .. +3, row r at [r % 32, (r // 32) % 4] and block j at [j % 4]. R and J are
    padded to 128 and 4 with a finite scale."""
    *lead, R, J = s_xRxJ.shape
    pad = [(0, 0)] * len(lead) + [(0, -R % _ATOM_ROWS), (0, -J % _ATOM_COLUMNS)]
    s = _padded(s_xRxJ, pad)
    Rt, Jt = s.shape[-2] // _ATOM_ROWS, s.shape[-1] // _ATOM_COLUMNS
    s = s.reshape(*lead, Rt, 4, 32, Jt, 4)
    n = len(lead)
    return s.transpose(*range(n), n, n + 3, n + 2, n + 1, n + 4)


def unpack_scales(packed: jax.Array, rows: int, blocks: int) -> jax.Array:
    """`pack_scales`' inverse: [..., rows, blocks]."""
    *lead, Rt, Jt = packed.shape[:-3]
    n = len(lead)
    s = packed.transpose(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return s.reshape(*lead, Rt * _ATOM_ROWS, Jt * _ATOM_COLUMNS)[..., :rows, :blocks]


def _row_scale_offsets(rows: int, blocks: int, ends_E: jax.Array) -> jax.Array:
    """int32 [Rp, J]: where scale (r, j) of a [rows, J] matrix blocked along the packed
    rows (J = M / 32 blocks of rows) sits in the weight gradient's flat buffer: each
    expert's blocks packed as their own [Rp, J_e] matrix (Rp: rows padded to 128), the
    experts one after another; the blocks past the last group are packed as one more."""
    Rp = -(-rows // _ATOM_ROWS) * _ATOM_ROWS
    bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_E // BLOCK,
                              jnp.full((1,), blocks, jnp.int32)])
    j = jnp.arange(blocks, dtype=jnp.int32)
    group = jnp.searchsorted(bounds[1:], j, side="right")  # the group block j is in
    start, width = bounds[group], bounds[group + 1] - bounds[group]
    r = jnp.arange(Rp, dtype=jnp.int32)[:, None]
    local = j - start
    return (Rp * start + ((r // _ATOM_ROWS) * (width // _ATOM_COLUMNS) + local // 4) * 512
            + (r % 32) * 16 + ((r // 32) % 4) * 4 + local % 4)


def pack_row_scales(s_RxJ: jax.Array, ends_E: jax.Array) -> jax.Array:
    """Scales [R, J] blocked along the packed rows, in the weight gradient's layout: a
    flat [Rp J] buffer, expert by expert (`_row_scale_offsets`)."""
    R, J = s_RxJ.shape
    s = _padded(s_RxJ, [(0, -R % _ATOM_ROWS), (0, 0)])
    offsets = _row_scale_offsets(R, J, ends_E)
    return jnp.zeros((s.size,), s.dtype).at[offsets.reshape(-1)].set(s.reshape(-1))


def unpack_row_scales(flat: jax.Array, rows: int, blocks: int, ends_E: jax.Array) -> jax.Array:
    """`pack_row_scales`' inverse: [rows, blocks]."""
    return flat[_row_scale_offsets(rows, blocks, ends_E)][:rows]


def _padded(s: jax.Array, pad) -> jax.Array:
    """e8m0 scales padded with `_PAD_SCALE` (through their bits: XLA pads no e8m0)."""
    bits = lax.bitcast_convert_type(s, jnp.uint8)
    return lax.bitcast_convert_type(jnp.pad(bits, pad, constant_values=_PAD_SCALE), s.dtype)


# ---------------------------------------------------------------- the kernels


def _forward_kernel(implementation: str, a, b, ends_E, out_dtype) -> jax.Array:
    """[M, K] x [E, N, K] -> [M, N]: rows of group e times expert e's [N, K]^T, both
    operands (elements, scales [.., K/32]) MXFP8 along K."""
    (qa, sa), (qb, sb) = a, b
    sa_packed, sb_packed = pack_scales(sa)[None], pack_scales(sb)
    if implementation == "cudnn":
        from jaxmoe.ops import cudnn_grouped
        out = cudnn_grouped.forward(qa, sa_packed, qb, sb_packed, ends_E, out_dtype)
    else:
        M, K = qa.shape
        J = K // BLOCK
        a32 = dequantize(qa, unpack_scales(sa_packed[0], M, J))
        b32 = dequantize(qb, unpack_scales(sb_packed, qb.shape[1], J))
        out = lax.ragged_dot(a32, jnp.swapaxes(b32, 1, 2), _sizes(ends_E),
                             preferred_element_type=jnp.float32).astype(out_dtype)
    return vary(out, varying_axes(qa) | varying_axes(qb))


def _weight_grad_kernel(implementation: str, a, b, ends_E) -> jax.Array:
    """[E, I, O] fp32: expert e's sum over its rows of a's columns times b's rows: a
    [I, M] and b [M, O] in bf16, or MXFP8 along the rows M, a (elements [I, M], scales
    [I, M/32]) and b (elements [M, O], scales [O, M/32])."""
    scaled = isinstance(a, tuple)
    (qa, sa), (qb, sb) = (a, b) if scaled else ((a, None), (b, None))
    if scaled:
        sa, sb = pack_row_scales(sa, ends_E), pack_row_scales(sb, ends_E)
    if implementation == "cudnn":
        from jaxmoe.ops import cudnn_grouped
        out = cudnn_grouped.weight_grad(qa, sa, qb, sb, ends_E)
    else:
        (I, M), O = qa.shape, qb.shape[1]
        a32, b32 = (qa.astype(jnp.float32), qb.astype(jnp.float32).T) if not scaled else (
            dequantize(qa, unpack_row_scales(sa, I, M // BLOCK, ends_E)),  # [I, M]
            dequantize(qb.T, unpack_row_scales(sb, O, M // BLOCK, ends_E)))  # [O, M]
        numbers = lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())
        out = lax.ragged_dot_general(a32.T, b32.T, _sizes(ends_E), numbers,
                                     preferred_element_type=jnp.float32)
    return vary(out, varying_axes(qa) | varying_axes(qb))


def _sizes(ends_E: jax.Array) -> jax.Array:
    return jnp.diff(ends_E, prepend=jnp.zeros((1,), ends_E.dtype))


# ---------------------------------------------------------------- the layer


class Options(NamedTuple):
    implementation: str  # "cudnn" or "reference"
    mxfp8_weight_grad: bool  # the weight gradient in MXFP8 (else bf16 operands)
    scale_rule: ScaleRule


def grouped_mx_linear(x_MxI: jax.Array, w: MXWeight, ends_E: jax.Array, options: Options,
                      kernels: Kernels | None = None) -> jax.Array:
    """[M, O]: the rows of group e (`ends_E`, aligned) of x times expert e's [I, O]
    weight, MXFP8 as the module says, in x's dtype. `w` holds the step's copies of the
    [E, I, O] weight (`quantize_weight`)."""
    if options.implementation not in IMPLEMENTATIONS:
        raise ValueError(f"grouped MXFP8 GEMM: {options.implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
    if x_MxI.shape[0] % ALIGN:
        raise ValueError(f"grouped MXFP8 GEMM: {x_MxI.shape[0]} rows is not a multiple of "
                         f"{ALIGN} (`aligned_rows`)")
    qx = lax.stop_gradient(quantize(x_MxI, -1, options.scale_rule))
    kernels = Kernels.default() if kernels is None else kernels
    return _grouped_mx(x_MxI, w.w, qx, (w.forward, w.forward_scales),
                       (w.dgrad, w.dgrad_scales), ends_E, options, kernels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _grouped_mx(x, w, qx, forward, dgrad, ends_E, options, kernels):
    return _forward_kernel(options.implementation, qx, forward, ends_E, x.dtype)


def _grouped_mx_fwd(x, w, qx, forward, dgrad, ends_E, options, kernels):
    # w is kept for its dtype and mesh axes: no GEMM reads it
    return _grouped_mx(x, w, qx, forward, dgrad, ends_E, options, kernels), (x, w, dgrad, ends_E)


def _grouped_mx_bwd(options, kernels, residuals, dy_MxO):
    x, w, dgrad, ends_E = residuals
    rule, impl = options.scale_rule, options.implementation
    summed = (varying_axes(dy_MxO) | varying_axes(dgrad[0])) - varying_axes(x)
    dx = _forward_kernel(impl, quantize(dy_MxO, -1, rule), dgrad, ends_E,
                         jnp.float32 if summed else x.dtype)
    if options.mxfp8_weight_grad:
        qxt = quantize(x.T, -1, rule)  # [I, M], blocked along the rows
        qdy, sdy = quantize(dy_MxO.T, -1, rule)  # [O, M]
        dw = _weight_grad_kernel(impl, qxt, (qdy.T, sdy), ends_E)
    elif impl == "cudnn":
        # tokamax's grouped GEMM reads x as it lies, where cuDNN's bf16 weight gradient
        # would need x^T written first (a full pass over the rows); its groups are the
        # aligned ones, padding included, named for the planner (`ALIGNED_SCOPE`)
        # stored in the weight's dtype where nothing sums it first (the fp32 result
        # would only be rounded to it): the same values, half the bytes written and
        # read again by whatever adds it up (a pipeline's or slices' gradient sum).
        # A mesh axis of one device sums nothing.
        summed_dw = any(lax.axis_size(a) > 1
                        for a in (varying_axes(x) | varying_axes(dy_MxO)) - varying_axes(w))
        with jax.named_scope(ALIGNED_SCOPE):
            dw = grouped_weight_grad(x.astype(jnp.bfloat16), dy_MxO.astype(jnp.bfloat16),
                                     _sizes(ends_E), kernels, "triton",
                                     jnp.float32 if summed_dw else w.dtype)
    else:
        dw = _weight_grad_kernel(impl, x.T.astype(jnp.bfloat16), dy_MxO.astype(jnp.bfloat16),
                                 ends_E)
    return like_primal(dx, x), like_primal(dw, w), None, None, None, None


_grouped_mx.defvjp(_grouped_mx_fwd, _grouped_mx_bwd)
