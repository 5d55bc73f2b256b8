"""benchmarks/gpu_checks.py at toy shapes on the 8 fake CPU devices: every check that
can run on CPU passes, the failure hook (JAXMOE_GPU_FAIL) makes the perturbed check
fail, and the checks XLA:CPU cannot run say why they skipped."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxmoe.runtime.fake_devices import without_fake_devices

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "benchmarks" / "gpu_checks.py")
gc = sys.modules["gpu_checks"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gc)


def _run(name, monkeypatch, fail=False):
    if fail:
        monkeypatch.setenv(gc.FAIL_ENV, name)
    else:
        monkeypatch.delenv(gc.FAIL_ENV, raising=False)
    result = gc.run_check(name, toy=True)
    assert result.line().startswith(f"{name}: ")
    return result


@pytest.mark.parametrize("name", ["stack", "ragged_plan", "alltoall_bf16", "ragged_fp32", "mxfp8",
                                  "train"])
def test_check_passes_and_its_hook_fails_it(name, monkeypatch):
    result = _run(name, monkeypatch)
    assert result.status == "PASS", result.line()  # ragged too, through its CPU lowering
    # the perturbation is applied to the computed answer (compiled programs are cached)
    spoiled = _run(name, monkeypatch, fail=True)
    assert spoiled.status == "FAIL", spoiled.line()


def test_the_gpu_compiler_here_is_the_cuda_extras_release():
    """tests/plan/test_gpu_compile.py compiles with the JAX, CUDA plugin and kernels that `pip
    install -e ".[cuda]"` installs on a GPU host, so CI cannot test a JAX that users do
    not get: the cuda extra pins every part of the stack to one release, cuda12 the same
    but its plugin, and gpu-compile (the test extra's compiler) the same releases, which
    are the ones installed. Companion: an extra naming another JAX is caught."""
    cuda = gc.extra_pins("cuda")
    assert set(cuda) == set(gc.STACK) - {"jax-cuda12-plugin"}, cuda
    assert all(map(gc.one_release, cuda.values())), cuda
    compiled_with = gc.extra_pins("gpu-compile")
    assert {k: gc.one_release(v) for k, v in compiled_with.items()} == {
        k: gc.one_release(v) for k, v in cuda.items()}
    assert gc.not_installed_as(compiled_with) == []
    cuda12 = gc.extra_pins("cuda12")
    assert cuda12.pop("jax-cuda12-plugin") == cuda.pop("jax-cuda13-plugin") and cuda12 == cuda
    older = dict(compiled_with, jax="==0.10.2")
    assert gc.not_installed_as(older) == [f"jax {jax.__version__}, the extra pins ==0.10.2"]


def test_checks_that_need_a_gpu_say_why_they_skip(monkeypatch):
    native = _run("mxfp8_native", monkeypatch)
    assert native.status == "SKIPPED"
    assert native.note.startswith("no native block-scaled GEMM on this device")
    grouped = _run("mxfp8_grouped", monkeypatch)
    assert grouped.status == "SKIPPED" and grouped.note.startswith("no cuDNN grouped MXFP8")
    overlap = _run("overlap", monkeypatch)
    assert overlap.status == "SKIPPED" and "XLA:CPU rejects" in overlap.note
    memory = _run("compile_memory", monkeypatch)
    assert memory.status == "SKIPPED" and memory.note.startswith("no GPU")
    roofline = _run("roofline", monkeypatch)
    assert roofline.status == "SKIPPED" and roofline.note == "no datasheet for a CPU"
    # `ragged` skips only for XLA:CPU's missing collective, never for another error
    missing = RuntimeError("UNIMPLEMENTED: HLO opcode ragged-all-to-all is not supported by XLA:CPU")
    assert gc.cpu_cannot_run_ragged(missing).startswith("XLA:CPU cannot run ragged_all_to_all")
    assert gc.cpu_cannot_run_ragged(ValueError("shapes do not match")) is None


def test_bit_for_bit_operands_are_exact_in_the_emulation():
    """The native check's premise: on its operands the emulated GEMM is exact, so any
    correct block-scaled GEMM must match it bit for bit."""
    a, b, exact = gc.exact_operands()
    emulated = np.asarray(jax.jit(gc.emulated_bmm)(a, b))
    np.testing.assert_array_equal(emulated, exact)
    # and the data is not trivially exact: a value off the e4m3 grid is not
    a[0, 0, 2] = 3.3
    assert not np.array_equal(np.asarray(jax.jit(gc.emulated_bmm)(a, b)), exact)


def test_grouped_operands_are_exact_in_the_contract():
    """The grouped check's premise: on its operands the grouped MXFP8 GEMMs' contract in
    XLA ("reference") is exact (forward, input and weight gradient against float64 over
    each expert's rows), so cuDNN's kernels must match it bit for bit. Companion: a value
    off the e4m3 grid is not exact."""
    from jaxmoe.ops import mx
    from jaxmoe.ops.mx_grouped import Options, grouped_mx_linear

    def run(x, w, dy, ends):
        def f(x_, w_):
            return grouped_mx_linear(x_, mx.quantize_weight(w_), ends,
                                     Options("reference", True, "ceil"))
        y, vjp = jax.vjp(f, x, w)
        return [np.asarray(a, np.float64) for a in (y, *vjp(dy))]

    x, w, dy, ends = gc.exact_grouped_operands(rows=(40, 0, 1, 300), I=64, O=96)
    y, dx, dw = run(x, w, dy, ends)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    starts = np.concatenate([[0], ends[:-1]])
    for e, (lo, hi) in enumerate(zip(starts, ends)):
        np.testing.assert_array_equal(y[lo:hi], x64[lo:hi] @ w64[e])
        np.testing.assert_array_equal(dx[lo:hi], dy64[lo:hi] @ w64[e].T)
        np.testing.assert_array_equal(dw[e], x64[lo:hi].T @ dy64[lo:hi])
    x[0, 1] = 3.3
    assert not np.array_equal(run(x, w, dy, ends)[0][0], x64[0] @ w64[0])


def test_main_reports_a_line_and_exits_on_failure(tmp_path, monkeypatch, capsys):
    table = tmp_path / "table.txt"
    monkeypatch.delenv(gc.FAIL_ENV, raising=False)
    assert gc.main(["ragged_plan", "--table", str(table)]) == 0
    monkeypatch.setenv(gc.FAIL_ENV, "ragged_plan")
    assert gc.main(["ragged_plan", "--table", str(table)]) == 1
    lines = table.read_text().splitlines()
    assert lines[0].endswith("PASS: R=8, C=64: rank 0's experts keep 0.28 of their 465 rows")
    assert lines[1].startswith("ragged_plan: 1 (<= 0) FAIL")
    monkeypatch.setenv(gc.FAIL_ENV, "no_such_check")  # a typo must not pass quietly
    assert gc.main(["ragged_plan"]) == 2


@pytest.mark.slow
def test_gpu_sh_smoke_fails_when_a_check_is_made_to_fail(tmp_path):
    """The script end to end on a few quick checks and one benchmark (the whole smoke
    run takes minutes): one spoiled check makes it exit non-zero, the rest still run."""
    env = without_fake_devices(os.environ)
    env |= {"JAXMOE_GPU_SMOKE": "1", "JAXMOE_GPU_FAIL": "ragged_plan",
            "JAXMOE_GPU_ONLY": "ragged_plan mxfp8_native overlap bench_moe"}
    proc = subprocess.run(["bash", "benchmarks/gpu.sh", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:]
    table = (tmp_path / "table.txt").read_text().splitlines()
    status = {line.split(":")[0]: line for line in table}
    assert list(status) == ["ragged_plan", "mxfp8_native", "overlap", "bench_moe"]
    assert ") FAIL" in status["ragged_plan"]
    assert ") SKIPPED: no native block-scaled GEMM" in status["mxfp8_native"]
    assert ") SKIPPED: XLA:CPU rejects" in status["overlap"]
    assert status["bench_moe"].endswith("PASS")
    assert proc.stdout.rstrip().splitlines()[-1].endswith("1 failed, 2 skipped")
    assert (tmp_path / "bench_moe.json").exists()
