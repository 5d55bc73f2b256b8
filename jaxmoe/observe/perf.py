"""What a run gets out of its devices: model FLOP/s and MFU, memory, where step time goes.

MFU is the model's training FLOPs (`jaxmoe.plan.counts.flops_per_token`: 6 x active matmul
parameters + attention, no recompute counted) per second, over the devices' dense
peak. The peak is the bf16 tensor-core figure from the table below (the usual
convention, also for runs with fp8 experts, so that fp8's gain shows as a higher
MFU); on CPU, where no such figure exists, it is a float32 matmul rate measured
once when the run starts, shared by the host's devices.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

# Dense (no sparsity) peak TFLOP/s per device: (bf16, fp8). Matched against
# `device.device_kind` in order, first match wins, so longer names come first.
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("GB200", 2500.0, 5000.0),
    ("B300", 2250.0, 4500.0),  # HGX B300: Blackwell Ultra's gain is in FP4, not here
    ("B200", 2250.0, 4500.0),
    ("H200", 989.0, 1979.0),
    ("H100 PCIe", 756.0, 1513.0),
    ("H100", 989.0, 1979.0),  # SXM
    ("H800", 989.0, 1979.0),
    ("A100", 312.0, 0.0),  # no fp8
    ("L40S", 362.0, 733.0),
    ("L40", 181.0, 362.0),
    ("L4", 121.0, 242.0),
    ("MI355X", 2500.0, 5000.0),
    ("MI325X", 1307.0, 2615.0),
    ("MI300X", 1307.0, 2615.0),
    ("TPU v6 lite", 918.0, 0.0),  # v6e (Trillium)
    ("TPU v5 lite", 197.0, 0.0),  # v5e
    ("TPU v5p", 459.0, 0.0),
    ("TPU v5", 459.0, 0.0),
    ("TPU v4", 275.0, 0.0),
)


def table_peak(device_kind: str, precision: str = "bf16") -> float | None:
    """Peak FLOP/s of one device of this kind, or None when the table lacks it."""
    for name, bf16, fp8 in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            tflops = bf16 if precision == "bf16" else fp8
            return tflops * 1e12 if tflops else None
    return None


def measure_matmul_rate(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of this host's float32 matmul (the best of `repeats`, after a warm-up)."""
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


@dataclass(frozen=True)
class Peak:
    flops_per_device: float  # dense bf16 (on CPU: the measured float32 matmul rate)
    source: str  # where the figure comes from, for the log
    fp8_flops_per_device: float | None = None  # where the device has fp8 tensor cores

    @classmethod
    def of(cls, devices) -> Peak | None:
        """The peak of these (same-kind) devices; None for an accelerator the table lacks."""
        kind = devices[0].device_kind
        if devices[0].platform == "cpu":
            rate = measure_matmul_rate()
            # Fake CPU devices share one host's cores.
            local = sum(d.process_index == jax.process_index() for d in devices)
            return cls(rate / local, f"cpu: a measured float32 matmul rate of {rate / 1e9:.0f} "
                                     f"GFLOP/s shared by {local} device(s)")
        flops = table_peak(kind)
        if not flops:
            return None
        return cls(flops, f"{kind}: {flops / 1e12:.0f} TFLOP/s bf16 dense", table_peak(kind, "fp8"))


def throughput(flops_per_token: float, tokens_per_s: float, num_devices: int,
               peak: Peak | None, fp8: bool = False) -> dict[str, float]:
    """Model TFLOP/s per device, and MFU where the peak is known; for a run with fp8
    matmuls (`fp8`) also `mfu_fp8`, against the fp8 peak, an upper bound's view."""
    per_device = flops_per_token * tokens_per_s / num_devices
    out = {"tflops_per_device": per_device / 1e12}
    if peak is not None:
        out["mfu"] = per_device / peak.flops_per_device
        if fp8 and peak.fp8_flops_per_device:
            out["mfu_fp8"] = per_device / peak.fp8_flops_per_device
    return out


def memory() -> dict[str, float]:
    """GB in use and at peak: the fullest local device where the backend reports it
    (GPU, TPU), else this process's resident memory (CPU, where the devices are host
    memory)."""
    stats = [s for s in (d.memory_stats() for d in jax.local_devices()) if s]
    if stats:
        return {"device_memory_gb": max(s.get("bytes_in_use", 0) for s in stats) / 1e9,
                "device_memory_peak_gb": max(s.get("peak_bytes_in_use", 0) for s in stats) / 1e9}
    # ru_maxrss is in KiB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc (macOS): the high-water mark stands in
        resident = peak
    # the kernel updates the high-water mark lazily: it can trail the current figure
    peak = max(peak, resident)
    return {"host_memory_gb": resident / 1e9, "host_memory_peak_gb": peak / 1e9}


class StepClock:
    """Splits the wall time between logged steps into waiting for data, host work
    (logging, evaluation, starting a checkpoint save, writing a profile) and the
    rest, `compute_s`: dispatching steps and waiting for the devices. Host work done
    while logging a step counts in the next logging window.

    Steps run asynchronously, so time spent reading the next batch overlaps the
    device's work on the previous step; `data_wait` is host time in the reader, an
    upper bound on the device's idle time for lack of data.
    """

    def __init__(self):
        self.start = time.perf_counter()
        self.data = self.host = 0.0

    @contextlib.contextmanager
    def timed(self, part: str):
        """Adds the time spent in the block to `part`: "data" or "host"."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, part, getattr(self, part) + time.perf_counter() - start)

    def split(self, steps: int) -> dict[str, float]:
        """Seconds per step since the last split, by part; restarts the clock."""
        now = time.perf_counter()
        wall = now - self.start
        out = {"step_time_s": wall / steps, "data_wait_s": self.data / steps,
               "host_s": self.host / steps,
               "compute_s": (wall - self.data - self.host) / steps}
        self.start, self.data, self.host = now, 0.0, 0.0
        return out


class ProfileWindow:
    """A jax.profiler trace of train steps [start, stop] into `directory` (one
    subdirectory per process when there are several): an XPlane file for
    TensorBoard's profile plugin and a Perfetto trace beside it.

    Each traced step is annotated with its number, so TensorBoard's profile plugin
    splits the trace by step. The trace starts once the steps before have finished
    on the devices and stops once the last traced step has, so it holds whole steps
    only. A run that resumes inside the window traces the rest of it.
    """

    def __init__(self, directory: Path, span: tuple[int, int] | None):
        if jax.process_count() > 1:  # each process writes its own trace files
            directory = directory / f"process_{jax.process_index()}"
        self.directory, self.span, self.active = directory, span, False

    def starts_at(self, step: int) -> bool:
        return bool(self.span) and not self.active and self.span[0] <= step <= self.span[1]

    def ends_at(self, step: int) -> bool:
        return self.active and step == self.span[1]

    def start(self) -> None:
        jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
        self.active = True

    def annotate(self, step: int):
        """A context for running train step `step`."""
        if self.active:
            return jax.profiler.StepTraceAnnotation("train", step_num=step)
        return contextlib.nullcontext()

    def stop(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()

    def __enter__(self):
        return self

    def __exit__(self, *exc):  # a run that stops early still leaves a readable trace
        try:
            self.stop()
        except Exception:
            if exc[0] is None:  # else the run's own error is the one to see
                raise
