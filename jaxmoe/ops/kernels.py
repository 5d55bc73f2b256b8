"""Which kernel each device-dependent op runs, decided from the devices its program is for.

A program compiled for GPUs on a CPU host (the planner, the GPU-compile tests)
must make the GPU's choices, so nothing here asks the host (`jax.devices()`,
the default backend): a layout (`jaxmoe.parallel.layout`) builds `Kernels` from
its mesh's devices (`Kernels.of_mesh`) and the model reads it from there. Only
a caller with no mesh at all gets the default device's (`Kernels.default`),
which is where a program without a mesh runs. The one exception is a limit
that JAX itself checks on the tracing host (`cudnn_head_max`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field, replace
from typing import Literal

from jaxmoe.config import ModelConfig, MoEConfig


_CUDNN_WIDTH = 64  # cuDNN's grouped MXFP8 GEMMs take outputs of a multiple of 64 columns


@functools.cache
def _cudnn_frontend() -> bool:
    """Whether cuDNN's frontend (its JAX grouped GEMMs) is installed: the `cuda` and
    `gpu-compile` extras hold it."""
    return importlib.util.find_spec("cudnn") is not None


@dataclass(frozen=True)
class Kernels:
    platform: str  # "cpu", "gpu" or "tpu", as `jax.Device.platform`
    device_kind: str
    compute_capability: tuple[int, int] | None = None  # NVIDIA GPUs only
    # one of the devices: what a kernel library that reads JAX's default device to pick
    # its tiles is traced with (`ops.grouped_gemm`), a virtual one for a deviceless compile
    device: object = field(default=None, compare=False)
    # the grouped expert GEMM's implementation where it is not the devices' choice: "xla"
    # runs the packed row layouts on CPU, for tests (`grouped_gemm`)
    expert_gemm: str | None = None

    @classmethod
    def of(cls, devices) -> Kernels:
        """The kernels of a program over these devices (a mesh holds one kind)."""
        devices = list(devices)
        kinds = {d.device_kind for d in devices}
        if len(kinds) > 1:
            raise ValueError(f"mesh: devices of several kinds {sorted(kinds)}; one program "
                             "compiles for one kind")
        d = devices[0]
        cc = getattr(d, "compute_capability", None)
        return cls(d.platform, d.device_kind,
                   tuple(int(v) for v in str(cc).split(".")[:2]) if cc else None, d)

    @classmethod
    def of_mesh(cls, mesh) -> Kernels:
        return cls.of(mesh.devices.flat)

    @classmethod
    def default(cls) -> Kernels:
        """The default device's: where a program runs that is given no mesh."""
        import jax
        return cls.of(jax.devices()[:1])

    @property
    def cuda(self) -> bool:
        return self.platform == "gpu" and self.compute_capability is not None

    @property
    def native_mxfp8(self) -> bool:
        """A block-scaled MXFP8 GEMM in hardware (cuDNN's, on Blackwell: compute
        capability 10+); elsewhere `jaxmoe.ops.mx` emulates it exactly."""
        return self.cuda and self.compute_capability >= (10, 0)

    def grouped_gemm(self, cfg: MoEConfig, d_model: int | None = None) -> str | None:
        """The grouped GEMM the experts run on exactly their routed rows, packed expert
        after expert: for bf16 experts tokamax's Triton kernel on NVIDIA GPUs
        (`jaxmoe.ops.grouped_gemm`); for MXFP8 experts cuDNN's grouped block-scaled
        GEMMs on Blackwell where its frontend is installed ("cudnn",
        `jaxmoe.ops.mx_grouped`). None: fixed per-expert buffers and a batched GEMM
        over all their rows, on CPU (where it is the fast path: a batched einsum) and
        for MXFP8 experts elsewhere (Hopper emulates MXFP8 in bf16 GEMMs). A set
        `expert_gemm` (the tests') runs the packed layouts on CPU: "xla", whose MXFP8
        counterpart is the kernels' contract in XLA ("reference"). cuDNN's kernels take
        widths (`d_model`, where the caller knows it, and `moe.expert_hidden`) that are
        multiples of 64; other widths run over buffers."""
        mxfp8 = cfg.expert_precision == "mxfp8"
        if self.expert_gemm is not None:
            return "reference" if mxfp8 and self.expert_gemm == "xla" else self.expert_gemm
        if not self.cuda:
            return None
        if mxfp8:
            widths = (cfg.expert_hidden, d_model or 0)
            fits = all(w % _CUDNN_WIDTH == 0 for w in widths)
            return "cudnn" if self.native_mxfp8 and fits and _cudnn_frontend() else None
        return "triton"

    def with_expert_gemm(self, implementation: str | None) -> Kernels:
        return replace(self, expert_gemm=implementation)

    @property
    def compiler_options(self) -> dict[str, bool | int]:
        """XLA options for a program compiled for these devices. On NVIDIA GPUs: XLA's
        latency-hiding scheduler, off by default in this XLA, without which a collective
        whose inputs are made right before it and whose result is used right after runs
        synchronously (the expert exchanges of every MoE layer); and up to 3 collectives
        in flight where XLA allows 1, counting those inside a loop body, without which
        nothing overlaps a pipeline iteration's exchanges, not even the ZeRO-1 gathers and
        reduce-scatters placed in it (benchmarks/RESULTS.md, "The GPU program's
        roofline": 3 beat 2 and 4 on the 1.2T config)."""
        if not self.cuda:
            return {}
        # an option the process's XLA_FLAGS name is theirs (benchmarks/gpu.sh turns it off)
        flags = os.environ.get("XLA_FLAGS", "")
        chosen = {"xla_gpu_enable_latency_hiding_scheduler": True,
                  "xla_gpu_experimental_parallel_collective_overlap_limit": 3}
        return {k: v for k, v in chosen.items() if f"--{k}=" not in flags}

    @property
    def native_ragged_exchange(self) -> bool:
        """XLA has `ragged-all-to-all` on GPU; XLA:CPU lacks it (`parallel.ragged_cpu`)."""
        return self.platform != "cpu"

    def attention(self, cfg: ModelConfig) -> Literal["cudnn", "xla", "blockwise"]:
        """cuDNN's fused flash attention on NVIDIA GPUs where it takes the inputs (16-bit,
        a head size that is a multiple of 8 and at most `cudnn_head_max`);
        `model.attention_block`'s online softmax when set; else XLA's, which holds the
        L x L scores."""
        if cfg.attention_block:
            return "blockwise"
        if (self.cuda and cfg.compute_dtype == "bfloat16" and cfg.head_size % 8 == 0
                and cfg.head_size <= self.cudnn_head_max):
            return "cudnn"
        return "xla"

    @property
    def cudnn_head_max(self) -> int:
        """cuDNN's flash attention takes heads up to 256 from Hopper on, 128 before. JAX
        checks the architecture on the GPU of the process that traces, so a program
        traced on a host without one gets 128 whatever its target, unless it is traced
        as the target's (`jaxmoe.plan.targets.traced_on`, the planner's)."""
        return 256 if self._cudnn_hopper else 128

    @property
    def _cudnn_hopper(self) -> bool:
        """Hopper or later, as JAX's check on the tracing host answers too."""
        if not (self.cuda and self.compute_capability >= (9, 0)):
            return False
        from jax._src.cudnn import fused_attention_stablehlo as fused
        return fused.check_compute_capability("9.0")
