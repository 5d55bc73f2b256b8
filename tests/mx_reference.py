"""NumPy reference of MXFP8 (OCP Microscaling Formats v1.0, e4m3 elements), written from
the spec and not from jaxmoe.ops.mx, to pin that module element for element.

Per block of 32 values V (the spec's conversion, with emax_elem = 8 for e4m3):
  shared_exp = floor(log2(max |V|)) - 8            rule "floor" (the spec's)
  shared_exp = ceil(log2(max |V| / 448))           rule "ceil" (what cuBLAS and
               Transformer Engine call RCEIL: the smallest power of two with
               max |V| / X <= 448)
clamped to e8m0's exponent range [-127, 127] (an all-zero block, log2(0) = -inf,
gets -127); X = 2^shared_exp; P_i = V_i / X rounded to the nearest e4m3 value, ties
to even. e4m3fn has no infinity: the spec clamps normal numbers to the largest
normal, so magnitudes past 448 saturate to +-448 (only the floor rule gets there).
Subnormal e4m3 results (multiples of 2^-9 below 2^-6) are kept, not flushed.
A block holding a NaN or an Inf has no finite shared exponent; its scale is e8m0's
NaN (0xFF), which by the spec makes every value of the block NaN whatever its
elements hold; the elements are written as e4m3fn NaN (0x7F) so that a reader that
ignores the scale still sees NaN.

The e4m3 rounding is integer arithmetic on float64 bit fields, not a cast (no
ml_dtypes, no XLA), so it is independent of the conversion jaxmoe relies on.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
E4M3_EMAX = 8  # exponent of e4m3's largest normal, 448 = 1.75 * 2^8
E4M3_NAN = 0x7F
E8M0_NAN = 0xFF
RULES = ("ceil", "floor")


def shared_exponents(amax: np.ndarray, rule: str) -> np.ndarray:
    """Unbiased e8m0 exponent of each block from its max magnitude (finite, >= 0)."""
    frac, exp = np.frexp(amax.astype(np.float64))  # amax = frac * 2^exp, frac in [0.5, 1)
    floor_log2 = exp.astype(np.int64) - 1
    if rule == "floor":
        e = floor_log2 - E4M3_EMAX
    elif rule == "ceil":  # amax <= 448 * 2^e  <=>  frac * 2^exp <= 0.875 * 2^(e + 9)
        e = exp.astype(np.int64) - 9 + (frac > 0.875)
    else:
        raise ValueError(rule)
    e = np.where(amax > 0, e, -127)
    # clamp to e8m0's range; the top is out of reach of float32 inputs (their max
    # gives 119 under floor, 120 under ceil)
    return np.clip(e, -127, 127)


def e4m3_bits(v: np.ndarray) -> np.ndarray:
    """float64 -> e4m3fn bit patterns (uint8): round to nearest, ties to even,
    saturating at +-448; NaN -> 0x7F."""
    v = np.asarray(v, np.float64)
    raw = v.view(np.uint64)
    sign = ((raw >> np.uint64(63)) << np.uint64(7)).astype(np.uint8)
    biased = ((raw >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64)
    # significand S as an integer: |v| = S * 2^(E - 52) with E = floor(log2 |v|);
    # float32 inputs scaled by a power of two are never float64 subnormals
    S = (raw & np.uint64((1 << 52) - 1)) | np.uint64(1 << 52)
    E = biased - 1023
    # e4m3 keeps 3 fraction bits: its quantum at exponent E is 2^(max(E, -6) - 3)
    Q = np.maximum(E, -6) - 3
    shift = 52 + Q - E  # >= 49; count quanta n = S / 2^shift, rounded
    big = shift >= 60  # |v| < 2^-7 * quantum: rounds to zero
    sh = np.where(big, 1, shift).astype(np.uint64)
    n = S >> sh
    rem = S & ((np.uint64(1) << sh) - np.uint64(1))
    half = np.uint64(1) << (sh - np.uint64(1))
    up = (rem > half) | ((rem == half) & ((n & np.uint64(1)) == 1))
    n = np.where(big, 0, n + up).astype(np.int64)
    # encode n * 2^Q: below 2^-6 the code is n itself (n = 8 is the smallest normal,
    # code 0x08); above, n in [8, 16], and a carry to 16 moves up one binade
    normal = E >= -6
    carry = normal & (n == 16)
    exp_field = np.where(carry, E + 1, E) + 7
    frac_field = np.where(carry, 0, n - 8)
    code = np.where(normal, (exp_field << 3) | frac_field, n)
    code = np.minimum(code, 0x7E)  # codes grow with magnitude: saturate at 448 (0x7E)
    code = np.where(v == 0, 0, code).astype(np.uint8) | sign
    return np.where(np.isnan(v), E4M3_NAN, code).astype(np.uint8)


def e4m3_value(bits: np.ndarray) -> np.ndarray:
    """e4m3fn bit patterns -> float64."""
    b = np.asarray(bits, np.uint8).astype(np.int64)
    exp_field, frac_field = (b >> 3) & 0xF, b & 7
    mag = np.where(exp_field == 0, np.ldexp(frac_field, -9),
                   np.ldexp(8 + frac_field, exp_field - 10))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return np.where(b & 0x80, -mag, mag)


def _blocks(x: np.ndarray, axis: int) -> np.ndarray:
    x = np.moveaxis(x, axis, -1)
    assert x.shape[-1] % BLOCK == 0, x.shape
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _unblock(xb: np.ndarray, axis: int) -> np.ndarray:
    return np.moveaxis(xb.reshape(*xb.shape[:-2], -1), -1, axis)


def quantize(x: np.ndarray, axis: int = -1, rule: str = "ceil") -> tuple[np.ndarray, np.ndarray]:
    """float32 x -> (e4m3fn element bits, e8m0 scale bits), both uint8, blocks of 32
    along `axis`; the scales have that axis divided by 32."""
    xb = _blocks(np.asarray(x, np.float32).astype(np.float64), axis)
    finite = np.isfinite(xb).all(-1)
    amax = np.where(finite, np.abs(np.where(np.isfinite(xb), xb, 0)).max(-1), 0.0)
    e = shared_exponents(amax, rule)
    elements = e4m3_bits(np.ldexp(xb, -e[..., None]))  # exact: a power-of-two scaling
    elements = np.where(finite[..., None], elements, E4M3_NAN).astype(np.uint8)
    scales = np.where(finite, e + 127, E8M0_NAN).astype(np.uint8)
    return _unblock(elements, axis), np.moveaxis(scales, -1, axis)


def dequantize(elements: np.ndarray, scales: np.ndarray, axis: int = -1) -> np.ndarray:
    """(e4m3fn bits, e8m0 bits) -> float64 values; a NaN scale makes its block NaN."""
    s = np.moveaxis(np.asarray(scales, np.uint8).astype(np.int64), axis, -1)[..., None]
    X = np.where(s == E8M0_NAN, np.nan, np.ldexp(1.0, s - 127))
    return _unblock(_blocks(e4m3_value(elements), axis) * X, axis)


def fake_quantize(x: np.ndarray, axis: int = -1, rule: str = "ceil") -> np.ndarray:
    """What an MXFP8 GEMM sees of x, in float64 (exact)."""
    return dequantize(*quantize(x, axis, rule), axis)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as float64; finite inputs."""
    raw = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    raw = (raw + 0x7FFF + ((raw >> 16) & 1)) & 0xFFFF0000
    return raw.astype(np.uint32).view(np.float32).astype(np.float64)


def gemm_tolerance(a_MxK: np.ndarray, b_KxN: np.ndarray) -> np.ndarray:
    """Bound on |fp32-accumulated a @ b - exact a @ b| for float64 operands that are
    exact in float32 with exact float32 products: K roundings of 2^-24 relative on
    partial sums no larger than sum |a_k b_k|, plus the output's rounding (Higham's
    gamma_K bound); batch axes broadcast."""
    K = a_MxK.shape[-1]
    return (K + 1) * 2.0 ** -24 * (np.abs(a_MxK) @ np.abs(b_KxN))


def assert_pinned(got, expected, tol, wrong: dict):
    """got is within fp32 accumulation error of expected, and each wrong variant is not
    (in most entries): the tolerance tells them apart."""
    err = np.abs(np.asarray(got, np.float64) - expected)
    assert (err <= tol).all(), f"{(err > tol).mean():.1%} outside, worst {(err / tol).max():.1f}x"
    for name, w in wrong.items():
        outside = (np.abs(w - expected) > tol).mean()
        assert outside > 0.9, f"{name} is indistinguishable: only {outside:.1%} of entries differ"
