"""MXFP8 (OCP Microscaling) quantisation: blocks of 32 values share one scale.

Each block of 32 consecutive values along the contraction axis is stored as
float8_e4m3fn elements times one power-of-two scale X in float8_e8m0fnu.

Scale rules (`scale_rule`, config `moe.mxfp8_scale`), with amax the block's max |v|:
- "ceil" (default): X = 2^ceil(log2(amax / 448)), the smallest power of two that
  maps amax into e4m3's range; what cuBLAS and Transformer Engine use (RCEIL).
  amax / X lies in (224, 448]: nothing saturates, and the block's smallest values
  lose at most one binade to the subnormal range compared with "floor".
- "floor": X = 2^(floor(log2 amax) - 8), the OCP MX v1.0 spec's rule (8: the
  exponent of e4m3's largest normal). amax / X lies in [256, 512): values past 448
  saturate, clipping the top of a block by up to 12.5%.
Either exponent is clamped to e8m0's [-127, 127]; an all-zero block gets 2^-127.
Elements: v / X rounded to nearest, ties to even (XLA's float32 -> e4m3fn cast),
saturating at +-448 as the spec allows. Subnormal e4m3 results (multiples of 2^-9)
are kept.
Special values: a block holding a NaN or an Inf gets the NaN scale (e8m0 0xFF) and
NaN elements, so the whole block dequantises to NaN (e4m3fn has no Inf).
tests/mx_reference.py is an independent NumPy reading of the spec that the tests
hold `quantize` to, bit for bit, under both rules.

Exponents and dequantisation work on float32 bit fields, and the scaling multiplies
an integer mantissa by normal powers of two built from bits: XLA:CPU treats float32
subnormals as zero in arithmetic and its exp2 and log2 are not exact at integers, and
either would change the bits of a block.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.ops.vma import vary, varying_axes

BLOCK = 32
E4M3_MAX = 448.0
SCALE_RULES = ("ceil", "floor")
ScaleRule = Literal["ceil", "floor"]

_MAG = 0x7FFFFFFF  # float32 bits without the sign
_INF = 0x7F800000  # float32 bits of Inf; magnitudes at or above it are Inf or NaN


def _blocks(x: jax.Array, axis: int) -> jax.Array:
    """x with `axis` split into (blocks, 32) where it stands (no transpose)."""
    axis = axis % x.ndim
    if x.shape[axis] % BLOCK:
        raise ValueError(f"MX quantisation: axis of size {x.shape[axis]} is not a multiple of {BLOCK}")
    return x.reshape(*x.shape[:axis], x.shape[axis] // BLOCK, BLOCK, *x.shape[axis + 1:])


def _unblock(xb: jax.Array, axis: int) -> jax.Array:
    axis = axis % (xb.ndim - 1)
    return xb.reshape(*xb.shape[:axis], -1, *xb.shape[axis + 2:])


def _fields(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 x -> (sign bit, m, k) with |x| = m * 2^k, m an integer below 2^24."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    biased, frac = (bits & _MAG) >> 23, bits & 0x7FFFFF
    m = jnp.where(biased > 0, frac | 0x800000, frac)
    k = jnp.maximum(biased, 1) - 150
    return bits & ~_MAG, m, k


def _compose(sign: jax.Array, m: jax.Array, k: jax.Array) -> jax.Array:
    """The float32 with `sign` and magnitude m * 2^k (m below 2^24), exact wherever that
    is a float32; Inf above float32's range; below its subnormals truncated."""
    width = 32 - jax.lax.clz(m)  # bits in m; 0 for m = 0
    e = width - 1 + k  # floor(log2 |x|)
    normal = ((e + 127) << 23) | ((m << (24 - width)) & 0x7FFFFF)
    up = k + 149  # subnormal: the integer m * 2^(k + 149) in units of 2^-149
    subnormal = jnp.where(up >= 0, m << jnp.clip(up, 0, 31), m >> jnp.clip(-up, 0, 31))
    # arithmetic, not selects against constants (see `quantize`)
    bits = jnp.where(e >= -126, normal, subnormal) * (m != 0)
    over = (e > 127).astype(jnp.int32)
    bits = bits * (1 - over) + _INF * over
    return jax.lax.bitcast_convert_type(bits | sign, jnp.float32)


def _pow2(d: jax.Array) -> jax.Array:
    """2^d as a float32, d in [-126, 127]: a normal number, built from its bits."""
    return jax.lax.bitcast_convert_type((d + 127) << 23, jnp.float32)


def _scaled_down(x: jax.Array, e: jax.Array) -> jax.Array:
    """float32 x / 2^e, exact wherever the result is at least 2^-102 (below it, 0 or a
    value that e4m3 rounds to 0, signed as x); finite x only (the caller masks the rest).
    |x| = m 2^k from the bit fields, then m (an integer below 2^24, so exactly a
    float32) times two normal powers of two: no float arithmetic sees a subnormal,
    which XLA:CPU would flush, and the integers need no per-element select."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    biased = (bits & _MAG) >> 23
    m = (bits & 0x7FFFFF) + (jnp.minimum(biased, 1) << 23)
    d = jnp.maximum(biased, 1) - 150 - e  # |x| / 2^e = m 2^d
    # |x| / 2^e <= 512, so d <= 9 and the first factor is exact; below 2^-126 it stops
    # at 2^-126 (m 2^-126 is normal) and the second takes the rest
    first = jnp.maximum(d, -126)
    value = m.astype(jnp.float32) * _pow2(first) * _pow2(jnp.maximum(d - first, -126))
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(value, jnp.int32) | (bits & ~_MAG), jnp.float32)


def _exponents(amax_bits: jax.Array, scale_rule: ScaleRule) -> jax.Array:
    """Unbiased scale exponent from the bits of a finite block max."""
    biased, frac = amax_bits >> 23, amax_bits & 0x7FFFFF
    e = biased - 127 - 8  # floor(log2 amax) - 8
    if scale_rule == "ceil":  # amax > 1.75 * 2^floor(log2 amax), and 448 = 1.75 * 2^8
        e = e + (frac > 0x600000)
    # a zero or subnormal amax is far below e8m0's floor; float32's max never reaches
    # its top (exponent 119 under floor, 120 under ceil)
    return jnp.clip(jnp.where(biased > 0, e, -127), -127, 127)


@functools.partial(jax.jit, static_argnames=("axis", "scale_rule"))
def quantize(x: jax.Array, axis: int = -1,
             scale_rule: ScaleRule = "ceil") -> tuple[jax.Array, jax.Array]:
    """x -> (elements e4m3fn, same shape as x; scales e8m0fnu, axis divided by 32)."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"MX scale rule {scale_rule!r} is not one of {list(SCALE_RULES)}")
    xb = _blocks(x.astype(jnp.float32), axis)  # axis -> (nblocks, 32)
    within = axis % x.ndim + 1  # the 32 values of a block
    # magnitudes order as their bit patterns, NaN and Inf above every finite value (an
    # integer max: XLA:CPU's vectorised float max drops NaN). Taken of abs(x), not of
    # the bits masked as `_scaled_down` masks them, so that XLA:GPU shares nothing per
    # element between the reduction and the elementwise pass: sharing that expression,
    # it wrote int32 magnitudes (4 bytes an element) and read them three times
    amax_bits = jnp.max(jax.lax.bitcast_convert_type(jnp.abs(xb), jnp.int32), axis=within)
    finite = amax_bits < _INF
    e = _exponents(jnp.where(finite, amax_bits, 0), scale_rule)
    scaled = jnp.clip(_scaled_down(xb, jnp.expand_dims(e, within)), -E4M3_MAX, E4M3_MAX)
    # selects against a constant would be hoisted out of the layer loops as
    # full-size broadcasts: multiply by 1 or NaN instead
    nan_or_one = jnp.expand_dims(jnp.where(finite, 1.0, jnp.nan), within)
    elements = (scaled * nan_or_one).astype(jnp.float8_e4m3fn)
    # e8m0 is a bare biased exponent, 0xFF = NaN
    bits = jnp.where(finite, e + 127, 255).astype(jnp.uint8)
    scales = jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)
    return _unblock(elements, axis), scales


@functools.partial(jax.jit, static_argnames=("axis", "dtype"))
def dequantize(elements: jax.Array, scales: jax.Array, axis: int = -1,
               dtype=jnp.float32) -> jax.Array:
    """(elements, scales) -> element * 2^scale, exact: every MXFP8 value up to float32's
    max is a float32 (those above, only reached by rounding at its top, become Inf)."""
    eb = _blocks(elements.astype(jnp.float32), axis)
    bits = jax.lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
    s = jnp.expand_dims(bits, axis % elements.ndim + 1)
    sign, m, k = _fields(eb)
    out = jnp.where(jnp.isnan(eb) | (s == 255), jnp.nan, _compose(sign, m, k + s - 127))
    return _unblock(out, axis).astype(dtype)


def fake_quantize(x: jax.Array, axis: int = -1, scale_rule: ScaleRule = "ceil") -> jax.Array:
    """Quantise-dequantise round trip in x's dtype: what an MXFP8 GEMM sees of x."""
    return dequantize(*quantize(x, axis, scale_rule), axis=axis, dtype=x.dtype)


# ---------------------------------------------------------------- MXFP8 batched matmul


class MXWeight(NamedTuple):
    """A stack of weights [..., I, O] with the two MXFP8 copies its GEMMs read, made once
    per optimizer step (`quantize_weight`) rather than in every micro-batch, layer
    iteration and pass: the forward GEMM contracts I, so its copy is blocked along I
    (stored [..., O, I], the GEMM's operand layout); the input gradient contracts O,
    so its copy is blocked along O. `w` is the primal the GEMMs return the gradient
    of; they never read its values."""

    w: jax.Array  # [..., I, O] in the compute dtype
    forward: jax.Array  # e4m3 [..., O, I]
    forward_scales: jax.Array  # e8m0 [..., O, I / 32]
    dgrad: jax.Array  # e4m3 [..., I, O]
    dgrad_scales: jax.Array  # e8m0 [..., I, O / 32]


def quantize_weight(w_xIxO: jax.Array, scale_rule: ScaleRule = "ceil") -> MXWeight:
    """`w` and its forward and input-gradient MXFP8 copies (any leading dims: a layer
    stack, experts). Gradient-free: the copies are constants of the step."""
    q = jax.lax.stop_gradient(w_xIxO)
    return MXWeight(w_xIxO, *quantize(jnp.swapaxes(q, -1, -2), -1, scale_rule),
                    *quantize(q, -1, scale_rule))


def _operand(q: tuple[jax.Array, jax.Array], native: bool):
    """What a GEMM reads of an MXFP8 operand: (elements, scales) for a native
    block-scaled GEMM, else the dequantised fp32 values."""
    return q if native else dequantize(*q)


def _gemm(a, b, out_dtype, native: bool) -> jax.Array:
    """[E, C, I] x [E, O, I] -> [E, C, O] on `_operand`s, fp32 accumulation, written in
    `out_dtype` (the hardware rounds its fp32 accumulator once, as the cast does)."""
    if native:
        (qa, sa), (qb, sb) = a, b
        out = jax.nn.scaled_matmul(qa, qb, sa, sb, preferred_element_type=out_dtype)
        # its result type forgets the mesh axes its operands vary over (inside shard_map,
        # jax 0.10 and 0.12 alike); restore them, or a custom VJP around it fails JAX's
        # type check
        return vary(out, varying_axes(qa) | varying_axes(qb))
    return jnp.einsum("eci,eoi->eco", a, b, preferred_element_type=jnp.float32).astype(out_dtype)


def mx_bmm(a_ExCxI: jax.Array, b_ExOxI: jax.Array, out_dtype,
           scale_rule: ScaleRule = "ceil", native: bool = False) -> jax.Array:
    """[E, C, I] x [E, O, I] -> [E, C, O] (E experts, C rows, I inputs, O outputs), both
    operands MXFP8 along the contracted I, fp32 accumulation.

    native: the hardware's block-scaled GEMM (`jax.nn.scaled_matmul`; where the
    target has one: `Kernels.native_mxfp8`); else the same quantisation, dequantised,
    in an fp32 einsum (bit-for-bit the inputs the hardware would see, so CPU runs
    predict GPU numerics).
    """
    return _gemm(_operand(quantize(a_ExCxI, -1, scale_rule), native),
                 _operand(quantize(b_ExOxI, -1, scale_rule), native), out_dtype, native)


def like_primal(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """Sums a cotangent over the mesh axes the primal does not vary over (as autodiff
    does for implicitly broadcast operands) and casts it to the primal's dtype."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    return (jax.lax.psum(ct, extra) if extra else ct).astype(primal.dtype)


# The custom VJP below takes its forward operands already quantised (computed
# outside, gradient stopped): a custom-VJP forward that quantises (and so mixes
# constants with device-varying values) cannot be differentiated inside a
# shard_map that a pipeline's stage vmap batches within scans (JAX's varying-axes
# check rejects the batched forward). Its backward rule may quantise freely.


def mx_linear(x_ExCxI: jax.Array, w: MXWeight | jax.Array, mxfp8_weight_grad: bool = False,
              scale_rule: ScaleRule = "ceil", native: bool = False) -> jax.Array:
    """Per-expert x @ w with MXFP8 operands in the forward and the input gradient.

    Forward: x blocked along I, w along I. Input gradient dx = dy @ w^T: dy and w
    blocked along O. Weight gradient dw = x^T @ dy over the rows C: bf16 operands
    with fp32 accumulation, or MXFP8 blocked along C when `mxfp8_weight_grad`.
    Every quantisation uses `scale_rule`; every MXFP8 GEMM is native or emulated
    as `native` says (see `mx_bmm`). `w`: [E, I, O], or its `MXWeight` made once
    per step (a plain array is quantised here, in every call).
    """
    w = w if isinstance(w, MXWeight) else quantize_weight(w, scale_rule)
    qx = jax.lax.stop_gradient(quantize(x_ExCxI, -1, scale_rule))
    forward = (w.forward, w.forward_scales)
    dgrad = (w.dgrad, w.dgrad_scales)
    return _mx_linear(x_ExCxI, w.w, qx, forward, dgrad, mxfp8_weight_grad, scale_rule, native)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _mx_linear(x, w, qx, forward, dgrad, mxfp8_weight_grad, scale_rule, native):
    return _gemm(_operand(qx, native), _operand(forward, native), x.dtype, native)


def _mx_linear_fwd(x, w, qx, forward, dgrad, mxfp8_weight_grad, scale_rule, native):
    # w is kept for its dtype and mesh axes only: no GEMM reads it, so XLA drops it
    return _mx_linear(x, w, qx, forward, dgrad, mxfp8_weight_grad, scale_rule, native), \
        (x, w, dgrad)


def _mx_linear_bwd(mxfp8_weight_grad, scale_rule, native, res, dy_ExCxO):
    x, w, dgrad = res
    # contracts O: [E, C, O] x [E, I, O]; in x's dtype unless it is still to be summed
    summed = (varying_axes(dy_ExCxO) | varying_axes(dgrad[0])) - varying_axes(x)
    dx = _gemm(_operand(quantize(dy_ExCxO, -1, scale_rule), native), _operand(dgrad, native),
               jnp.float32 if summed else x.dtype, native)
    xt, dyt = jnp.swapaxes(x, 1, 2), jnp.swapaxes(dy_ExCxO, 1, 2)  # [E, I, C], [E, O, C]
    if mxfp8_weight_grad:
        dw = mx_bmm(xt, dyt, jnp.float32, scale_rule, native)
    else:
        dw = jnp.einsum("ekc,enc->ekn", xt.astype(jnp.bfloat16), dyt.astype(jnp.bfloat16),
                        preferred_element_type=jnp.float32)
    return like_primal(dx, x), like_primal(dw, w), None, None, None


_mx_linear.defvjp(_mx_linear_fwd, _mx_linear_bwd)


# ---------------------------------------------------------------- MXFP8 projections


class Options(NamedTuple):
    """How a projection's MXFP8 GEMMs run (`mx_linear`'s static arguments)."""
    scale_rule: ScaleRule = "ceil"
    weight_grad: bool = False  # the weight gradient in MXFP8 too (else bf16 operands)
    native: bool = False  # the target's block-scaled GEMM (else emulated exactly)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["copies"],
                   meta_fields=["options"])
@dataclasses.dataclass(frozen=True)
class MXProjection:
    """A dense projection's weight as a step's layers read it in MXFP8: `copies.w` is the
    weight as stored, [*In, *Out] (after any stacked axes), and `copies`' MXFP8 copies
    are of it as one [I, O] matrix (I the product of In, O of Out)."""

    copies: MXWeight
    options: Options


def quantize_projection(w: jax.Array, inputs: int, outputs: int,
                        scale_rule: ScaleRule = "ceil") -> MXWeight:
    """The MXFP8 copies (`quantize_weight`, `w` left out) of a projection weight
    [..., *In, *Out] with `inputs` input and `outputs` output axes last (any axes before
    them stacked: layers, stages), as [..., I, O]."""
    lead = w.shape[:w.ndim - inputs - outputs]
    I = math.prod(w.shape[len(lead):w.ndim - outputs])
    return quantize_weight(w.reshape(*lead, I, -1), scale_rule)._replace(w=None)


def mx_project(x: jax.Array, w: MXProjection, inputs: int) -> jax.Array:
    """x's last `inputs` axes contracted with the weight's first `inputs` axes, both
    operands MXFP8 (`mx_linear` on x's rows, I and O flattened), in x's dtype."""
    weight = w.copies.w
    I, O = math.prod(weight.shape[:inputs]), math.prod(weight.shape[inputs:])
    if x.shape[x.ndim - inputs:] != weight.shape[:inputs] or w.copies.forward.shape != (O, I):
        raise ValueError(f"MXFP8 projection: x {x.shape} does not contract the first "
                         f"{inputs} axes of a weight {weight.shape} whose copies are "
                         f"{w.copies.forward.shape[::-1]}")
    copies = MXWeight(weight.reshape(1, I, O), *(c[None] for c in w.copies[1:]))
    o = w.options
    y = mx_linear(x.reshape(1, -1, I), copies, o.weight_grad, o.scale_rule, o.native)
    return y.reshape(*x.shape[:x.ndim - inputs], *weight.shape[inputs:])
