"""MXFP8 (OCP Microscaling) quantisation: blocks of 32 values share one scale.

Each block of 32 consecutive values along the contraction axis is stored as
float8_e4m3fn elements times one power-of-two scale in float8_e8m0fnu.

Scale choice: X = 2^ceil(log2(amax / 448)), the smallest power of two that maps
the block's max magnitude into e4m3's range (|v| / X <= 448). The spec's
floor-based rule (2^(floor(log2 amax) - 8)) can put amax / X up to 511 and
saturate the top of the block by up to 12.5%; rounding the exponent up never
saturates and costs at most one bit of the smallest values' range.
Elements: v / X rounded to nearest, ties to even (XLA's float -> e4m3fn cast).
Bounds: relative error <= 2^-4 for |v| / X >= 2^-6 (e4m3 normals); below that
(subnormals) absolute error <= 2^-10 * X.
Special values: an all-zero block gets the smallest scale 2^-127 and zero
elements; a block holding a NaN or an Inf gets the NaN scale (e8m0 0xFF), so the
whole block dequantises to NaN (e4m3fn has no Inf). Scales clamp to [2^-127, 2^127].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BLOCK = 32
E4M3_MAX = 448.0


def _blocks(x: jax.Array, axis: int) -> jax.Array:
    x = jnp.moveaxis(x, axis, -1)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"MX quantisation: axis of size {x.shape[-1]} is not a multiple of {BLOCK}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def quantize(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """x -> (elements e4m3fn, same shape as x; scales e8m0fnu, axis divided by 32)."""
    xb = _blocks(x.astype(jnp.float32), axis)  # [..., nblocks, 32]
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    finite = jnp.all(jnp.isfinite(xb), axis=-1, keepdims=True)
    exponent = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-38) / E4M3_MAX))
    exponent = jnp.clip(jnp.where(amax > 0, exponent, -127.0), -127.0, 127.0)
    # e8m0 is a bare biased exponent (0xFF = NaN); built from bits, since 2^-127
    # is an fp32 subnormal that a float cast may flush to zero
    bits = jnp.where(finite, exponent + 127.0, 255.0).astype(jnp.uint8)
    scale = jax.lax.bitcast_convert_type(bits[..., 0], jnp.float8_e8m0fnu)
    # a power-of-two scaling is exact; the clip only guards rounding at the top
    scaled = jnp.clip(xb * jnp.exp2(-exponent), -E4M3_MAX, E4M3_MAX)
    elements = jnp.where(finite, scaled, jnp.nan).astype(jnp.float8_e4m3fn)
    elements = jnp.moveaxis(elements.reshape(*elements.shape[:-2], -1), -1, axis)
    scales = jnp.moveaxis(scale, -1, axis)
    return elements, scales


def dequantize(elements: jax.Array, scales: jax.Array, axis: int = -1,
               dtype=jnp.float32) -> jax.Array:
    eb = _blocks(elements.astype(jnp.float32), axis)
    bits = jax.lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.float32)
    scale = jnp.where(bits == 255, jnp.nan, jnp.exp2(bits - 127.0))
    s = jnp.moveaxis(scale, axis, -1)[..., None]
    out = (eb * s).reshape(*eb.shape[:-2], -1)
    return jnp.moveaxis(out, -1, axis).astype(dtype)


def fake_quantize(x: jax.Array, axis: int = -1) -> jax.Array:
    """Quantise-dequantise round trip in x's dtype: what an MXFP8 GEMM sees of x."""
    return dequantize(*quantize(x, axis), axis=axis, dtype=x.dtype)


# ---------------------------------------------------------------- MXFP8 batched matmul


def _native() -> bool:
    """cuDNN's block-scaled GEMM: Blackwell GPUs (compute capability 10+) only."""
    device = jax.devices()[0]
    return device.platform == "gpu" and float(getattr(device, "compute_capability", 0)) >= 10


def _quantized_operands(a_BxMxK: jax.Array, b_BxNxK: jax.Array):
    """What an MXFP8 GEMM reads of its operands: (elements, scales) pairs where the
    hardware takes them natively, else the dequantised fp32 values."""
    qa, qb = quantize(a_BxMxK), quantize(b_BxNxK)
    if _native():
        return qa, qb
    return dequantize(*qa), dequantize(*qb)


def _gemm(a, b, out_dtype) -> jax.Array:
    """[B, M, K] x [B, N, K] -> [B, M, N] on `_quantized_operands`, fp32 accumulation."""
    if _native():
        (qa, sa), (qb, sb) = a, b
        out = jax.nn.scaled_matmul(qa, qb, sa, sb, preferred_element_type=jnp.float32)
    else:
        out = jnp.einsum("bmk,bnk->bmn", a, b, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def mx_bmm(a_BxMxK: jax.Array, b_BxNxK: jax.Array, out_dtype) -> jax.Array:
    """[B, M, K] x [B, N, K] -> [B, M, N], both operands MXFP8 along K, fp32 accumulation.

    Native block-scaled GEMM where the backend has one; elsewhere the same
    quantisation, dequantised, in an fp32 einsum (bit-for-bit the inputs the
    hardware would see, so CPU runs predict GPU numerics).
    """
    return _gemm(*_quantized_operands(a_BxMxK, b_BxNxK), out_dtype)


def _varying(a: jax.Array) -> frozenset:
    """Mesh axes `a` varies over inside shard_map (empty outside)."""
    aval = jax.typeof(a)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def _like_primal(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """Sums a cotangent over the mesh axes the primal does not vary over (as autodiff
    does for implicitly broadcast operands) and casts it to the primal's dtype."""
    extra = tuple(sorted(_varying(ct) - _varying(primal)))
    return (jax.lax.psum(ct, extra) if extra else ct).astype(primal.dtype)


# The custom VJPs below take their forward operands already quantised (computed
# outside, gradient stopped): a custom-VJP forward that quantises (and so mixes
# constants with device-varying values) cannot be differentiated inside a
# shard_map that a pipeline's stage vmap batches within scans (JAX's varying-axes
# check rejects the batched forward). Their backward rules may quantise freely.


def mx_linear(x_ExCxK: jax.Array, w_ExKxN: jax.Array, mxfp8_weight_grad: bool = False) -> jax.Array:
    """Per-expert x @ w with MXFP8 operands in the forward and the input gradient.

    Forward: x blocked along K, w along K. Input gradient dx = dy @ w^T: dy and w
    blocked along N. Weight gradient dw = x^T @ dy over the rows C: bf16 operands
    with fp32 accumulation, or MXFP8 blocked along C when `mxfp8_weight_grad`.
    """
    qx, qw = jax.lax.stop_gradient(_quantized_operands(x_ExCxK, jnp.swapaxes(w_ExKxN, 1, 2)))
    return _mx_linear(x_ExCxK, w_ExKxN, qx, qw, mxfp8_weight_grad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _mx_linear(x, w, qx, qw, mxfp8_weight_grad):
    return _gemm(qx, qw, x.dtype)


def _mx_linear_fwd(x, w, qx, qw, mxfp8_weight_grad):
    return _gemm(qx, qw, x.dtype), (x, w)


def _mx_linear_bwd(mxfp8_weight_grad, res, dy_ExCxN):
    x, w = res
    dx = mx_bmm(dy_ExCxN, w, jnp.float32)  # contracts N: [E, C, N] x [E, K, N]
    xt, dyt = jnp.swapaxes(x, 1, 2), jnp.swapaxes(dy_ExCxN, 1, 2)  # [E, K, C], [E, N, C]
    if mxfp8_weight_grad:
        dw = mx_bmm(xt, dyt, jnp.float32)
    else:
        dw = jnp.einsum("ekc,enc->ekn", xt.astype(jnp.bfloat16), dyt.astype(jnp.bfloat16),
                        preferred_element_type=jnp.float32)
    return _like_primal(dx, x), _like_primal(dw, w), None, None


_mx_linear.defvjp(_mx_linear_fwd, _mx_linear_bwd)


def mx_ragged_linear(x_MxK: jax.Array, w_GxKxN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    """`lax.ragged_dot` (rows grouped contiguously per expert) with MXFP8 operands in the
    forward and the input gradient, bf16 weight gradients; emulated on every backend
    (no native block-scaled ragged GEMM is exposed)."""
    fx, fw = jax.lax.stop_gradient((fake_quantize(x_MxK, -1), fake_quantize(w_GxKxN, 1)))
    return _mx_ragged_linear(x_MxK, w_GxKxN, group_sizes_G, fx, fw)


@jax.custom_vjp
def _mx_ragged_linear(x, w, group_sizes, fx, fw):
    return jax.lax.ragged_dot(fx, fw, group_sizes,
                              preferred_element_type=jnp.float32).astype(x.dtype)


def _mx_ragged_fwd(x, w, group_sizes, fx, fw):
    return _mx_ragged_linear(x, w, group_sizes, fx, fw), (x, w, group_sizes)


def _mx_ragged_bwd(res, dy_MxN):
    x, w, group_sizes = res
    w_GxNxK = jnp.swapaxes(fake_quantize(w, 2), 1, 2)
    dx = jax.lax.ragged_dot(fake_quantize(dy_MxN, -1), w_GxNxK, group_sizes,
                            preferred_element_type=jnp.float32)
    _, weight_vjp = jax.vjp(
        lambda w_: jax.lax.ragged_dot(x.astype(jnp.bfloat16), w_.astype(jnp.bfloat16), group_sizes,
                                      preferred_element_type=jnp.float32), w)
    (dw,) = weight_vjp(dy_MxN.astype(jnp.float32))
    return _like_primal(dx, x), _like_primal(dw, w), None, None, None


_mx_ragged_linear.defvjp(_mx_ragged_fwd, _mx_ragged_bwd)
