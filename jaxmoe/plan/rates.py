"""What kernels measurably reach on each GPU generation: the planner's expected step.

The roofline (`jaxmoe.plan.roofline`) prices every kernel at the datasheet's peaks,
a bound no GPU reaches. The same walk of the compiled program priced at these
rates is the expected step: each class of kernel at the fraction of its
datasheet figure that GPUs of that generation have been measured to reach, by
shape where the measurements say shape matters. Every row names its source and
date; a row that is an assumption says so, and what it stands in for.

    matrix product    FLOPs / (peak x gemm(FLOPs of the product)), the fraction
                      interpolated in log(FLOPs) between measured points; fp8
                      operands at the fp8 peak times `fp8`; a grouped GEMM
                      also times `grouped(rows per group)`; cuDNN's
                      block-scaled MXFP8 GEMM at `block_scaled` times the
                      bf16 rate; fused attention at `attention_forward` or
                      `attention_backward` of the bf16 peak
    memory-bound      bytes / (HBM bandwidth x `hbm`)
    every kernel      + `launch_s` (no command buffer hides launches in the
                      programs the planner reads)
    collective        bytes / (link x `scale_up` | `all_to_all` | `scale_out`)
                      + `latency_s`
    host copy         bytes / (host link x `host_copy`)

A kernel takes the larger of its products' and its bytes' time, as in the bound.
To refit a row from a lent GPU: `benchmarks/gpu.sh` prints each check's measured
figure beside the expected one; a class whose ratio is off by more than its
spread gets the measured fraction, with the date and the command, here.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Rate:
    value: float
    source: str  # who measured it, on what, when
    assumed: bool = False  # no measurement: what it stands in for is in `source`


@dataclass(frozen=True)
class Rates:
    """One GPU generation's measured fractions of its datasheet figures."""

    generation: str
    # (FLOPs of one product, fraction of the dense bf16 peak), FLOPs rising
    gemm: tuple[tuple[float, float], ...]
    gemm_source: str
    fp8: Rate  # an fp8 GEMM's fraction of the fp8 peak, over the bf16 fraction at its size
    # (rows per group, grouped GEMM's rate over a dense GEMM of the same FLOPs), rising
    grouped: tuple[tuple[float, float], ...]
    grouped_source: str
    block_scaled: Rate  # cuDNN's MXFP8 GEMM's rate over bf16 at the same shape
    attention_forward: Rate  # fraction of the bf16 peak
    attention_backward: Rate
    hbm: Rate
    scale_up: Rate  # NVLink, all-gather / reduce-scatter / all-reduce
    all_to_all: Rate  # NVLink, an exchange of token rows
    scale_out: Rate  # the network between hosts
    latency_s: Rate  # one collective's fixed cost
    launch_s: Rate  # one kernel's uncovered launch and tail
    host_copy: Rate  # a copy to or from pinned host memory, of the host link

    def gemm_fraction(self, flops: float) -> float:
        return _interpolate(self.gemm, flops)

    def grouped_factor(self, rows_per_group: float) -> float:
        return _interpolate(self.grouped, rows_per_group)

    def rows(self) -> list[tuple[str, str, str, bool]]:
        """(name, value, source, assumed) of every row, for the planner's printout."""
        out = [("gemm", ", ".join(f"{_si(f)}: {v:.2f}" for f, v in self.gemm),
                self.gemm_source, False),
               ("grouped", ", ".join(f"{r:g} rows: {v:.2f}" for r, v in self.grouped),
                self.grouped_source, False)]
        for name in ("fp8", "block_scaled", "attention_forward", "attention_backward", "hbm",
                     "scale_up", "all_to_all", "scale_out", "latency_s", "launch_s",
                     "host_copy"):
            r = getattr(self, name)
            out.append((name, f"{r.value:g}", r.source, r.assumed))
        return out


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Linear in log(x) between points, flat past either end."""
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + t * (y1 - y0)


def _si(flops: float) -> str:
    return f"{flops:.0e}".replace("e+", "e")


# Sources, as they are cited below:
# [xla-mm]   XLA's measured GEMM table (xla/service/gpu/model/default_matmul_perf_table
#            .txtpb, formerly matmul_interpolator_data.h; openxla/xla as of 2026-08-22):
#            CUPTI kernel time, b in {1, 2, 4} x m, n, k in {256 ... 4096}; here the
#            median fraction of the dense bf16 peak per half-decade of 2 b m n k.
#            sm_90 is an H100 SXM (4096^3: 780 TFLOP/s, 0.79), sm_100 a B200 (4096^3:
#            1,417, 0.63). Its H100 fp8 rows exceed the fp8 datasheet peak (up to
#            2.6 PFLOP/s): not used.
# [xla-coll] XLA's measured collective table (default_collective_perf_table.txtpb, same
#            commit): 8 GPUs on NVLink, one-op executables' median wall time; bus
#            bandwidth at 256 MiB over NVLink's 450 (H100) or 900 (B200) GB/s per
#            direction. H100: all-gather 0.72, reduce-scatter 0.68, all-to-all 0.69;
#            B200: 0.60, 0.59, 0.57 (GB300 NVL72, 8 x 8: 0.66, 0.67, 0.62). Its
#            smallest messages take 18-24 us (H100) and 28-31 us (B200), launch
#            included: an upper bound on a collective's fixed cost inside a program.
# [olmo]     OLMo-core 3 report (2026), appendix A.11: B300 (1.1 kW HGX) bf16 dense
#            GEMMs at the model's shapes 1,411-1,422 TFLOP/s (0.63 of 2.25 PF, as
#            [xla-mm]'s B200 at 4096^3); grouped GEMMs 0.94-0.96x dense at 256-4,096
#            rows per expert, ~0.6x at <= 128; MXFP8 grouped 1.2-1.4x bf16 at 32K rows;
#            ~2.8 us uncovered per kernel in a 64 x B300 trace.
# [fa3]      FlashAttention-3 (Shah et al., 2024), H100 SXM5 bf16, head 128, causal,
#            16K tokens: forward ~640 TFLOP/s (0.65), backward ~500 (0.5).
# [stream]   STREAM triad on H100 SXM and H200: 0.86-0.89 of the HBM datasheet figure.
# [cublaslt] cuBLASLt fp8 GEMMs on H100: 0.58-0.70 of the fp8 peak, where bf16 reaches
#            ~0.79 at the same shapes.

HOPPER = Rates(
    generation="hopper",
    gemm=((1e8, 0.023), (1e9, 0.144), (1e10, 0.535), (3.16e10, 0.730), (1e11, 0.749),
          (3.16e11, 0.810)),
    gemm_source="[xla-mm] sm_90 (H100 SXM), bf16, median per half-decade of FLOPs",
    fp8=Rate(0.80, "[cublaslt] 0.58-0.70 of the fp8 peak where bf16 reaches 0.79"),
    grouped=((128, 0.60), (256, 0.94), (4096, 0.96)),
    grouped_source="[olmo] measured on B300; Hopper's grouped kernels assumed alike",
    block_scaled=Rate(1.3, "assumed, never used: Hopper has no MXFP8 (its fp8 GEMMs are "
                            "plain fp8)", assumed=True),
    attention_forward=Rate(0.65, "[fa3] H100 SXM5 forward"),
    attention_backward=Rate(0.50, "[fa3] H100 SXM5 backward"),
    hbm=Rate(0.87, "[stream] H100 SXM, H200: 0.86-0.89"),
    scale_up=Rate(0.70, "[xla-coll] 8 x H100: all-gather 0.72, reduce-scatter 0.68 of "
                        "NVLink at 256 MiB (all-reduces priced alike; they reach 0.83)"),
    all_to_all=Rate(0.69, "[xla-coll] 8 x H100, NCCL's all-to-all at 256 MiB"),
    scale_out=Rate(0.80, "assumed: NCCL over one 400 Gb/s NIC per GPU (no measured table; "
                         "XLA's own model assumes 25 GB/s per GPU)", assumed=True),
    latency_s=Rate(20e-6, "[xla-coll] 8 x H100, smallest messages (18-24 us)"),
    launch_s=Rate(2.8e-6, "assumed: [olmo]'s uncovered time per kernel on B300",
                  assumed=True),
    host_copy=Rate(0.80, "assumed: pinned copies over PCIe Gen5 x16 reach ~52 of its 64 GB/s "
                         "per direction (no measured table)", assumed=True),
)

BLACKWELL = Rates(
    generation="blackwell",
    gemm=((1e8, 0.009), (1e9, 0.072), (1e10, 0.337), (3.16e10, 0.516), (1e11, 0.596),
          (3.16e11, 0.652)),
    gemm_source="[xla-mm] sm_100 (B200), bf16, median per half-decade of FLOPs; [olmo]'s "
                "B300 0.63 at the model's shapes agrees",
    fp8=Rate(0.95, "[xla-mm] sm_100 (B200) e4m3: 0.99x bf16's fraction at >= 1e11 FLOPs, "
                   "0.79x at >= 1e10"),
    grouped=((128, 0.60), (256, 0.94), (4096, 0.96)),
    grouped_source="[olmo] B300, grouped over dense at 128, 256-4,096 rows per expert",
    block_scaled=Rate(1.3, "[olmo] B300 MXFP8 grouped 1.2-1.4x bf16 at 32K rows"),
    attention_forward=Rate(0.65, "assumed: [fa3]'s H100 fraction, for cuDNN on Blackwell",
                           assumed=True),
    attention_backward=Rate(0.50, "assumed: [fa3]'s H100 fraction, for cuDNN on Blackwell",
                            assumed=True),
    hbm=Rate(0.87, "assumed: [stream]'s H100 and H200 fraction, for HBM3e on Blackwell",
             assumed=True),
    scale_up=Rate(0.60, "[xla-coll] 8 x B200: all-gather 0.60, reduce-scatter 0.59 of "
                        "NVLink at 256 MiB (GB300 racks reach 0.66: priced alike)"),
    all_to_all=Rate(0.57, "[xla-coll] 8 x B200, NCCL's all-to-all at 256 MiB (DeepEP's "
                          "kernels reach 0.81)"),
    scale_out=Rate(0.80, "assumed: NCCL over one 400-800 Gb/s NIC per GPU (no measured "
                         "table)", assumed=True),
    latency_s=Rate(30e-6, "[xla-coll] 8 x B200, smallest messages (28-31 us)"),
    launch_s=Rate(2.8e-6, "[olmo] uncovered per kernel in a 64 x B300 trace"),
    host_copy=Rate(0.80, "assumed: as Hopper's PCIe Gen5 copies, for PCIe and for GB300's "
                         "NVLink-C2C (no measured table)", assumed=True),
)

# CUDA compute capability's major version -> generation
BY_MAJOR = {9: HOPPER, 10: BLACKWELL}


def rates_for(compute_capability: str) -> Rates:
    major = int(compute_capability.split(".")[0])
    if major not in BY_MAJOR:
        raise ValueError(f"no measured rates for compute capability {compute_capability} "
                         f"(have {sorted(BY_MAJOR)})")
    return BY_MAJOR[major]
