"""GPUs to compile for without one: specs, datasheet figures and virtual devices.

The CUDA plugin of the pinned JAX carries XLA:GPU's whole compiler, and it
compiles for a GPU that is not there: a device spec (`gpu_specs/NAME.txtpb`, a
`GpuTargetConfigProto`) and a topology (hosts x GPUs per host) give virtual
devices; a mesh over them and `jit(f).trace(...).lower().compile()` give the
optimized GPU program (its HLO, its buffers) that a GPU host would run. Nothing
is allocated and no GPU is needed, so the planner and the tests read the real
GPU program on a CPU machine.

Needs the `gpu-compile` extra (`pip install -e ".[gpu-compile]"`) and
JAX_PLATFORMS=cpu before JAX starts (else the plugin looks for a GPU and JAX has
no CUDA topology to offer); `python -m jaxmoe.plan` sets it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

_SPECS = Path(__file__).parent / "gpu_specs"
EXTRA = 'pip install -e ".[gpu-compile]"'


@dataclass(frozen=True)
class Target:
    """A GPU as the planner sees it; peak FLOP/s come from `jaxmoe.observe.perf.PEAK_TFLOPS`."""

    name: str  # the spec's file name, and the planner's --target
    scale_up: float  # bytes/s per direction per GPU within a host (NVLink)
    scale_out: float  # bytes/s per direction per GPU between hosts (its network adapter)
    gpus_per_host: int = 8  # GPUs on one NVLink domain: a host, or a rack's NVLink switches
    chip: str = ""  # the device spec's name where it is another target's GPU
    host_link: float = 64e9  # bytes/s per direction between the GPU and its host's memory

    @cached_property
    def spec(self) -> str:
        return (_SPECS / f"{self.chip or self.name}.txtpb").read_text()

    def _field(self, name: str) -> str:
        return re.search(rf'^\s*{name}:\s*"?([^"\n]+)"?', self.spec, re.M).group(1)

    @property
    def device_kind(self) -> str:
        """What the driver calls the device (`jax.Device.device_kind`)."""
        return self._field("device_description_str")

    @property
    def memory(self) -> int:
        """Bytes of device memory."""
        return int(self._field("device_memory_size"))

    @property
    def hbm_bandwidth(self) -> float:
        """Bytes/s of device memory (the spec's `memory_bandwidth`)."""
        return float(self._field("memory_bandwidth"))

    @property
    def compute_capability(self) -> str:
        major, minor = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)",
                                 self.spec).groups()
        return f"{major}.{minor}"

    def peak(self, precision: str = "bf16") -> float:
        from jaxmoe.observe.perf import table_peak
        return table_peak(self.device_kind, precision)


# NVLink per direction: 450 GB/s on Hopper (NVLink 4), 900 GB/s on Blackwell (NVLink 5).
# Network: one 400 Gb/s ConnectX-7 per GPU on HGX H100, H200 and B200 systems, one
# 800 Gb/s ConnectX-8 per GPU on HGX B300. GB300 NVL72: the B300's chip, 72 of them
# on one NVLink domain (a rack's NVLink switches), ConnectX-8 between racks; a "host"
# of the planner's topology is then a rack's share of the GPUs.
# Host memory (offloaded activations): PCIe Gen5 x16 on HGX systems, 64 GB/s per
# direction (HGX B300's ConnectX-8 switches speak Gen6, its Xeon hosts Gen5);
# NVLink-C2C to the Grace CPU on GB300, 900 GB/s both ways, 450 per direction. Both
# are one GPU's link alone: GPUs that share a switch's uplink (HGX) or a Grace's
# memory (GB300) and offload at once get less, so offloading priced at them is a
# lower bound of its cost.
TARGETS = {
    "h100": Target("h100", 450e9, 50e9),
    "h200": Target("h200", 450e9, 50e9),
    "b200": Target("b200", 900e9, 50e9),
    "b300": Target("b300", 900e9, 100e9),
    "gb300": Target("gb300", 900e9, 100e9, gpus_per_host=72, chip="b300", host_link=450e9),
}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"target: {name!r} is not one of {sorted(TARGETS)}")
    return TARGETS[name]


def topology(target: Target, num_devices: int, hosts: int | None = None) -> str:
    """The plugin's "partitions x hosts x GPUs per host" for `num_devices` GPUs on
    `hosts` hosts (None: full hosts of `gpus_per_host`, filled one after another)."""
    if hosts is None:
        hosts = max(1, -(-num_devices // target.gpus_per_host))
    per = num_devices // hosts
    if per * hosts != num_devices or per > target.gpus_per_host:
        raise ValueError(f"target {target.name}: {num_devices} GPUs do not split into {hosts} "
                         f"hosts of at most {target.gpus_per_host}")
    return f"1x{hosts}x{per}"


def gpu_compiler_available() -> bool:
    """Whether the CUDA plugin (the GPU compiler) is installed."""
    return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None


def virtual_devices(target: Target | str, num_devices: int, hosts: int | None = None) -> list:
    """`num_devices` virtual GPUs of `target` on `hosts` hosts (see `topology`), host by
    host (`process_index` is the host), for a `Mesh` whose programs compile for that GPU."""
    target = get_target(target) if isinstance(target, str) else target
    if not gpu_compiler_available():
        raise RuntimeError(f"compiling for {target.name} needs the GPU compiler: {EXTRA}")
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(
            platform="cuda", topology=topology(target, num_devices, hosts),
            target_config=target.spec)
    except NotImplementedError as e:  # JAX started with the CUDA plugin as a backend
        raise RuntimeError(f"compiling for {target.name}: JAX has no CUDA topology ({e}); set "
                           "JAX_PLATFORMS=cpu before JAX starts") from e
    return list(topo.devices)


def compile_deviceless(lowered, compiler_options: dict | None = None):
    """`lowered.compile(compiler_options)` for a program lowered on virtual devices. A
    deviceless executable cannot be read back from JAX's compilation cache (it has no
    client to load into), so none is written there: the cache is off, and where this
    process has used it already (JAX decides that once), no compile is slow enough to
    be kept.

    Without a device there is nothing to autotune: at its default level XLA 0.12's
    config assigner still compiles each fusion's candidate kernels, only to keep the
    first that compiles (two thirds of a compile); at level 0 it keeps that one at once,
    and the program is the same (`benchmarks/RESULTS.md`, "jaxmoe on jax 0.12"). A level
    in the caller's options or XLA_FLAGS is theirs."""
    import jax
    options = dict(compiler_options or {})
    if "--xla_gpu_autotune_level=" not in os.environ.get("XLA_FLAGS", ""):
        options.setdefault("xla_gpu_autotune_level", 0)
    kept = {"jax_enable_compilation_cache": False,
            "jax_persistent_cache_min_compile_time_secs": math.inf}
    before = {name: getattr(jax.config, name) for name in kept}
    for name, value in kept.items():
        jax.config.update(name, value)
    try:
        return lowered.compile(options)
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


@contextlib.contextmanager
def traced_on(device):
    """Trace and lower as a host with `device` (a GPU, virtual or not) would. JAX asks
    the tracing process's own GPU what cuDNN's fused attention takes (heads over 128
    wide from Hopper on: MLA's 192); a CPU host has none, so the question is answered
    with `device`'s compute capability for the trace. Private to JAX: checked by the
    GPU-compile tests. On Blackwell, cuDNN's grouped MXFP8 GEMMs ask the CUDA driver
    while tracing and compile their kernels while lowering: answered for `device` too
    (`jaxmoe.ops.cudnn_grouped.deviceless`), where the frontend is installed."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    cc = getattr(device, "compute_capability", None)
    if cc is None:
        yield
        return
    have = tuple(int(v) for v in str(cc).split(".")[:2])
    wanted = lambda capability: tuple(int(v) for v in capability.split("."))  # noqa: E731
    saved = fused.check_compute_capability, fused.is_cuda_compute_capability_equal
    fused.check_compute_capability = lambda c: have >= wanted(c)
    fused.is_cuda_compute_capability_equal = lambda c: have == wanted(c)
    try:
        with contextlib.ExitStack() as stack:
            if have >= (10, 0) and importlib.util.find_spec("cudnn") is not None:
                from jaxmoe.ops.cudnn_grouped import deviceless
                stack.enter_context(deviceless(have, device.core_count))
            yield
    finally:
        fused.check_compute_capability, fused.is_cuda_compute_capability_equal = saved
