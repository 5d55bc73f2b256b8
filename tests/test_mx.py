"""MXFP8 quantisation: error within the documented bounds, special values."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.ops.mx import BLOCK, dequantize, fake_quantize, quantize


def _check_bounds(x):
    q, s = quantize(jnp.asarray(x))
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float8_e8m0fnu
    assert s.shape == x.shape[:-1] + (x.shape[-1] // BLOCK,)
    y = np.asarray(dequantize(q, s))
    scale = 2.0 ** (np.asarray(s).view(np.uint8).astype(np.float64) - 127)  # e8m0: biased exponent
    X = np.repeat(scale, BLOCK, axis=-1)
    normal = np.abs(x) / X >= 2.0 ** -6
    rel = np.abs(y - x)[normal] / np.abs(x)[normal]
    assert rel.max() <= 2.0 ** -4 + 1e-7
    assert (np.abs(y - x)[~normal] <= 2.0 ** -10 * X[~normal] + 1e-45).all()
    # the scale is a power of two that maps the block max to at most 448, never saturating
    amax = np.abs(x).reshape(*x.shape[:-1], -1, BLOCK).max(-1)
    assert (amax / scale <= 448).all() and (amax / scale > 224).all()
    return rel.max()


def test_random_heavy_tailed_and_tiny():
    rng = np.random.default_rng(0)
    for x in [rng.normal(size=(64, 256)),
              rng.standard_t(df=1.5, size=(64, 256)) * 1e3,  # heavy tails
              rng.normal(size=(64, 256)) * 1e-30]:  # tiny magnitudes
        worst = _check_bounds(x.astype(np.float32))
        assert worst > 2.0 ** -7  # the bound is close to what happens: not a vacuous test


def test_zero_nan_inf_blocks():
    x = np.ones((2, 64), np.float32)
    x[0, :32] = 0.0  # all-zero block
    x[1, 3] = np.nan
    x[1, 40] = np.inf
    y = np.asarray(fake_quantize(jnp.asarray(x)))
    assert (y[0, :32] == 0).all() and (y[0, 32:] == 1).all()
    assert np.isnan(y[1]).all()  # both blocks of row 1 hold a NaN or an Inf
    _, s = quantize(jnp.asarray(x))
    bits = np.asarray(s).view(np.uint8)
    assert bits[0, 0] == 0 and bits[1, 0] == 255 and bits[1, 1] == 255  # 2^-127, NaN, NaN


def test_axis_and_shape_errors():
    x = np.random.default_rng(1).normal(size=(64, 96)).astype(np.float32)
    a = np.asarray(fake_quantize(jnp.asarray(x), axis=0))
    b = np.asarray(fake_quantize(jnp.asarray(x.T), axis=-1)).T
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize(jnp.ones((4, 48)))
