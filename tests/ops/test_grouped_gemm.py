"""The grouped GEMM over packed expert rows (`jaxmoe.ops.grouped_gemm`) against a
float64 GEMM per expert: forward and both gradients, with an empty expert, a one-row
expert, group starts off tile boundaries and free rows past the groups. On CPU
the reference implementation runs; the GPU kernels (mosaic, triton) are compiled
for H100 and B300 and counted in tests/plan/test_gpu_compile.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.ops.grouped_gemm import grouped_matmul, grouped_weight_grad
from jaxmoe.ops.kernels import Kernels

I, O = 24, 40  # a GEMM's inputs and outputs
ROWS = [0, 1, 37, 0, 26, 9]  # empty, one row, unaligned starts (1, 38, 64)
C = sum(ROWS) + 7  # rows: 7 free ones past the groups


def _problem():
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (C, I), jnp.float32)
    w = jax.random.normal(kw, (len(ROWS), I, O), jnp.float32)
    dy = jax.random.normal(kd, (C, O), jnp.float32)
    return x, w, dy


def _reference(x, w, dy, rows):
    """float64 per expert: y, dL/dx and dL/dw of L = sum(y * dy) over the groups' rows."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    y, dx, dw = np.zeros((C, O)), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for g, n in enumerate(rows):
        block = slice(start, start + n)
        y[block] = x[block] @ w[g]
        dx[block] = dy[block] @ w[g].T
        dw[g] = x[block].T @ dy[block]
        start += n
    return y, dx, dw


@jax.jit
def _run(x, w, dy, rows):
    kernels = Kernels.default()
    y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, rows, kernels, "xla"), x, w)
    return y, *vjp(dy)


def _tolerance(x, w, dy) -> float:
    """fp32 dots of at most 37 terms (the largest group, the weight gradient's sum):
    rounding stays below n x 2^-24 x sum |terms|, bounded by the largest |a| |b|."""
    big = float(jnp.max(jnp.abs(x))) * max(float(jnp.max(jnp.abs(w))),
                                            float(jnp.max(jnp.abs(dy))))
    return max(ROWS + [I, O]) ** 2 * 2.0 ** -24 * big


def test_grouped_gemm_equals_a_gemm_per_expert():
    x, w, dy = _problem()
    rows = jnp.asarray(ROWS, jnp.int32)
    y, dx, dw = _run(x, w, dy, rows)
    ref = _reference(x, w, dy, ROWS)
    used = sum(ROWS)  # the free rows' outputs are unspecified (the GPU kernels skip them)
    tol = _tolerance(x, w, dy)
    np.testing.assert_allclose(np.asarray(y)[:used], ref[0][:used], atol=tol, rtol=0)
    np.testing.assert_allclose(np.asarray(dx)[:used], ref[1][:used], atol=tol, rtol=0)
    np.testing.assert_allclose(np.asarray(dw), ref[2], atol=tol, rtol=0)
    assert not np.any(np.asarray(dw)[[0, 3]])  # empty experts get no gradient
    # companion: one row moved from expert 2 to expert 1 shows in all three
    moved = [0, 2, 36, 0, 26, 9]
    y2, dx2, dw2 = _run(x, w, dy, jnp.asarray(moved, jnp.int32))
    for got, want in zip((y2, dx2, dw2), ref):
        got = np.asarray(got)[:used] if got.shape[0] == C else np.asarray(got)
        want = want[:used] if want.shape[0] == C else want
        assert not np.allclose(got, want, atol=1e-3)


def test_the_weight_gradient_is_rounded_once_to_the_dtype_asked():
    """The weight gradient stored in bf16 (`mx_grouped`'s, where nothing sums it before
    it meets a bf16 weight) is its fp32 sum rounded once: what the fp32 result cast to
    bf16 gave. Companion: the fp32 result is not already bf16, so the rounding is seen."""
    x, _, dy = _problem()
    x, dy = x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)
    rows, kernels = jnp.asarray(ROWS, jnp.int32), Kernels.default()
    dw32 = grouped_weight_grad(x, dy, rows, kernels, "xla")
    dw16 = grouped_weight_grad(x, dy, rows, kernels, "xla", jnp.bfloat16)
    assert dw32.dtype == jnp.float32 and dw16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dw16, np.float32),
                                  np.asarray(dw32.astype(jnp.bfloat16), np.float32))
    assert not np.array_equal(np.asarray(dw16, np.float32), np.asarray(dw32))


def test_an_unknown_implementation_is_named():
    x, w, _ = _problem()
    with pytest.raises(ValueError, match="'cutlass' is not one of"):
        grouped_matmul(x, w, jnp.asarray(ROWS, jnp.int32), Kernels.default(), "cutlass")


def test_gpus_choose_the_kernel_and_cpu_the_buffers():
    from jaxmoe.config import MoEConfig
    bf16, mx = MoEConfig(), MoEConfig(expert_precision="mxfp8")
    h100 = Kernels("gpu", "NVIDIA H100 80GB HBM3", (9, 0))
    b300 = Kernels("gpu", "NVIDIA B300", (10, 3))
    assert h100.grouped_gemm(bf16) == b300.grouped_gemm(bf16) == "triton"
    # MXFP8 experts: cuDNN's grouped block-scaled GEMMs on Blackwell; Hopper emulates
    # MXFP8 over buffers
    assert b300.grouped_gemm(mx) == "cudnn" and h100.grouped_gemm(mx) is None
    # widths its kernels do not take (multiples of 64) run over buffers
    assert b300.grouped_gemm(mx, d_model=96) is None
    assert b300.grouped_gemm(MoEConfig(expert_precision="mxfp8", expert_hidden=96)) is None
    assert Kernels("cpu", "cpu").grouped_gemm(bf16) is None
    assert Kernels("cpu", "cpu").grouped_gemm(mx) is None
    assert Kernels("cpu", "cpu").with_expert_gemm("xla").grouped_gemm(bf16) == "xla"
    assert Kernels("cpu", "cpu").with_expert_gemm("xla").grouped_gemm(mx) == "reference"


def test_triton_writes_ptx_for_the_ptxas_that_assembles_it(monkeypatch, tmp_path):
    """jaxlib assembles a jax-triton kernel with the first ptxas on PATH: Triton is
    pointed at that one (its PTX version follows the ptxas it is given), unless the
    caller chose. Companion: another ptxas first on PATH is the one chosen."""
    import os

    from jaxmoe.ops import grouped_gemm

    variables = ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ptxas").write_text("#!/bin/sh\n")
        (tmp_path / name / "ptxas").chmod(0o755)
    for v in variables:  # recorded as they are, so that the teardown puts that back
        monkeypatch.setenv(v, "")
    for order in (("first", "second"), ("second", "first")):
        for v in variables:
            monkeypatch.delenv(v)
        monkeypatch.setenv("PATH", os.pathsep.join(str(tmp_path / d) for d in order))
        grouped_gemm._triton_writes_for_the_assembler()
        assert {os.environ[v] for v in variables} == {str(tmp_path / order[0] / "ptxas")}
    monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", "/opt/mine/ptxas")
    grouped_gemm._triton_writes_for_the_assembler()
    assert os.environ["TRITON_PTXAS_BLACKWELL_PATH"] == "/opt/mine/ptxas"
