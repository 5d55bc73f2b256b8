"""The grouped MXFP8 GEMM on aligned packed rows (`jaxmoe.ops.mx_grouped`): the scale
atoms against the kernels' closed-form layout, and the forward and both gradients of
the "reference" implementation (the kernels' contract, what CPU runs) against a float64
GEMM of the same MXFP8 operands (quantised by tests/mx_reference.py), with an empty
expert, a one-row expert, groups past 256 rows and free rows past the groups holding
garbage. Companions: a group end off by one row, and padding rows left unzeroed, both
fail. The cuDNN kernels themselves are compiled for B300 in tests/ops/test_cudnn_grouped.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mx_reference as ref
from jaxmoe.ops.mx import quantize_weight
from jaxmoe.ops.mx_grouped import (ALIGN, Options, aligned_ends, aligned_rows, grouped_mx_linear,
                                   pack_row_scales, pack_scales, unpack_row_scales,
                                   unpack_scales)

ROWS = [3, 0, 300, 1]  # routed rows of each expert: not multiples of 256, empty, one row
I, O = 64, 96  # neither a multiple of 128: the atoms' padding is exercised
E8M0 = jnp.float8_e8m0fnu


def _e8m0(bits: np.ndarray) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.asarray(bits, jnp.uint8), E8M0)


def _bits(a) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(a), jnp.uint8))


def test_atoms_follow_the_kernels_closed_form():
    """Scale (r, j) of a [R, J] matrix sits at byte (r // 128) Jt 512 + (j // 4) 512 +
    (r % 32) 16 + ((r // 32) % 4) 4 + j % 4 of its atoms (CUTLASS's
    `tile_atom_to_shape_SF`, K-major); a leading expert axis stacks whole matrices."""
    rng = np.random.default_rng(0)
    for R, J in [(256, 16), (200, 6), (128, 4)]:
        s = rng.integers(0, 255, (3, R, J)).astype(np.uint8)
        packed = _bits(pack_scales(_e8m0(s)))
        Rt, Jt = -(-R // 128), -(-J // 4)
        assert packed.shape == (3, Rt, Jt, 32, 4, 4)
        r, j = np.meshgrid(np.arange(R), np.arange(J), indexing="ij")
        at = (r // 128) * Jt * 512 + (j // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + j % 4
        for e in range(3):
            np.testing.assert_array_equal(packed[e].reshape(-1)[at], s[e])
        pad = np.ones(packed[0].size, bool)
        pad[at.reshape(-1)] = False
        assert (packed[0].reshape(-1)[pad] == 127).all()  # finite padding, never 0xFF
        np.testing.assert_array_equal(_bits(unpack_scales(pack_scales(_e8m0(s)), R, J)), s)


def test_weight_gradient_scales_are_packed_expert_by_expert():
    """Blocked along the rows, each expert's blocks are their own [Rp, J_e] matrix in
    atoms, the experts one after another (Rp J_start the offset of expert e's)."""
    rng = np.random.default_rng(1)
    R, M = 200, 1536
    ends = aligned_ends(jnp.asarray(ROWS))
    J = M // 32
    s = rng.integers(0, 255, (R, J)).astype(np.uint8)
    flat = _bits(pack_row_scales(_e8m0(s), ends))
    Rp = 256
    bounds = [0, *(np.asarray(ends) // 32), J]
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi == lo:
            continue
        block = np.full((Rp, hi - lo), 127, np.uint8)
        block[:R] = s[:, lo:hi]
        own = _bits(pack_scales(_e8m0(block))).reshape(-1)
        np.testing.assert_array_equal(flat[Rp * lo: Rp * hi], own)
    np.testing.assert_array_equal(_bits(unpack_row_scales(pack_row_scales(_e8m0(s), ends), R, J,
                                                          ends)), s)


def test_aligned_ends_and_rows():
    np.testing.assert_array_equal(aligned_ends(jnp.asarray(ROWS)), [256, 256, 768, 1024])
    assert aligned_rows(sum(ROWS), len(ROWS)) == 512 + 4 * 256  # any 304 rows over 4 experts
    assert aligned_rows(0, 1) == 256


def _layout(rng, garbage_padding: bool = False):
    """x, dy [M, .] with each expert's rows at its aligned start, zero padding (or
    garbage), garbage in the free rows past the groups; and the real rows' slices."""
    ends = np.asarray(aligned_ends(jnp.asarray(ROWS)))
    M = aligned_rows(sum(ROWS), len(ROWS))
    u_I, v_O = 2.0 ** rng.integers(-6, 7, I), 2.0 ** rng.integers(-6, 7, O)
    x = (rng.normal(size=(M, I)) * u_I).astype(np.float32)
    dy = (rng.normal(size=(M, O)) / v_O).astype(np.float32)
    w = (rng.normal(size=(len(ROWS), I, O)) / u_I[:, None] * v_O).astype(np.float32)
    groups, start = [], 0
    for n, end in zip(ROWS, ends):
        groups.append(slice(start, start + n))
        if not garbage_padding:
            x[start + n:end] = 0.0
            dy[start + n:end] = 0.0
        start = end
    return x, w, dy, groups, ends


def _run(x, w, dy, ends, mxfp8_weight_grad, rule="ceil"):
    options = Options("reference", mxfp8_weight_grad, rule)
    def f(x_, w_):
        return grouped_mx_linear(x_, quantize_weight(w_, rule), jnp.asarray(ends), options)

    y, vjp = jax.vjp(jax.jit(f), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    return (np.asarray(a, np.float64) for a in (y, dx, dw))


def _expected(x, w, dy, groups, mxfp8_weight_grad, rule="ceil"):
    """float64 GEMMs of the MXFP8 operands each GEMM reads, over each expert's rows."""
    fq = lambda a, axis: ref.fake_quantize(a, axis, rule)  # noqa: E731
    xq, dyq = fq(x, 1), fq(dy, 1)  # along I, along O
    w_fwd, w_dgrad = fq(w, 1), fq(w, 2)  # along I, along O
    if mxfp8_weight_grad:
        xr, dyr = fq(x, 0), fq(dy, 0)  # along the rows
    else:
        xr, dyr = ref.bf16_round(x), ref.bf16_round(dy)
    y, dx, dw = np.zeros((x.shape[0], O)), np.zeros_like(xq), np.zeros(w.shape)
    ty, tdx, tdw = np.zeros_like(y), np.zeros_like(dx), np.zeros_like(dw)
    for e, rows in enumerate(groups):
        y[rows], ty[rows] = xq[rows] @ w_fwd[e], ref.gemm_tolerance(xq[rows], w_fwd[e])
        dx[rows] = dyq[rows] @ w_dgrad[e].T
        tdx[rows] = ref.gemm_tolerance(dyq[rows], w_dgrad[e].T)
    return y, dx, dw, ty, tdx, tdw, xr, dyr


def _weight_grad(xr, dyr, spans):
    dw = np.zeros((len(spans), I, O))
    tol = np.zeros_like(dw)
    for e, rows in enumerate(spans):
        dw[e] = xr[rows].T @ dyr[rows]
        tol[e] = ref.gemm_tolerance(xr[rows].T, dyr[rows])
    return dw, tol


@pytest.mark.parametrize("mxfp8_weight_grad", [False, True])
def test_forward_and_gradients_match_float64(mxfp8_weight_grad):
    rng = np.random.default_rng(2)
    x, w, dy, groups, ends = _layout(rng)
    y, dx, dw = _run(x, w, dy, ends, mxfp8_weight_grad)
    want_y, want_dx, _, ty, tdx, _, xr, dyr = _expected(x, w, dy, groups, mxfp8_weight_grad)
    real = np.concatenate([np.arange(s.start, s.stop) for s in groups])
    padding = np.setdiff1d(np.arange(ends[-1]), real)
    # the routed rows as the float64 GEMMs give them; the padding rows zero
    assert (np.abs(y - want_y)[real] <= ty[real]).all()
    assert (np.abs(dx - want_dx)[real] <= tdx[real]).all()
    assert (y[padding] == 0).all() and (dx[padding] == 0).all()
    spans = [slice(s.start, e) for s, e in zip(groups, ends)]  # a group's rows, padding too
    want_dw, tdw = _weight_grad(xr, dyr, spans)
    assert (np.abs(dw - want_dw) <= tdw).all()
    assert np.abs(dw[1]).max() == 0.0  # the empty expert
    # teeth: MXFP8 operands change the products beyond the accumulation's error
    assert (np.abs(y - np.asarray(x, np.float64) @ w[0])[groups[0]] > ty[groups[0]]).any()


def test_a_group_end_off_by_one_row_fails():
    rng = np.random.default_rng(3)
    x, w, dy, groups, ends = _layout(rng)
    off = ends.copy()
    off[2] += 1  # expert 3's first row counted as expert 2's
    y, _, dw = _run(x, w, dy, off, True)
    want_y, *_ = _expected(x, w, dy, groups, True)
    first_of_3 = groups[3].start
    assert np.abs(y[first_of_3] - want_y[first_of_3]).max() > 1e-3 * np.abs(want_y).max()


def test_padding_rows_left_unzeroed_fail():
    rng = np.random.default_rng(4)
    x, w, dy, groups, ends = _layout(rng, garbage_padding=True)
    _, _, dw = _run(x, w, dy, ends, True)
    _, _, _, _, _, _, xr, dyr = _expected(x, w, dy, groups, True)
    want_dw, tdw = _weight_grad(xr, dyr, groups)  # what the routed rows alone give
    assert (np.abs(dw - want_dw) > tdw).mean() > 0.5


def test_rows_not_aligned_are_refused():
    x = jnp.zeros((ALIGN + 32, I), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 256"):
        grouped_mx_linear(x, quantize_weight(jnp.zeros((1, I, O))), jnp.asarray([ALIGN]),
                          Options("reference", False, "ceil"))
