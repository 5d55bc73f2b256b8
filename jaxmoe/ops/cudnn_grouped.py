"""cuDNN's grouped block-scaled MXFP8 GEMMs (nvidia-cudnn-frontend's JAX entry points,
on CUTLASS's `cutlass_call`), and what compiling them for a GPU without one takes.

`forward` is `grouped_gemm_quant_jax_forward`: a [M, K] e4m3 times each group's
expert of [E, N, K] e4m3, e8m0 scales in 128 x 4 atoms, int32 cumulative group ends
(multiples of 256), a per-expert fp32 alpha (1 here), a bf16/fp32 [M, N] out.
`weight_grad` is `grouped_gemm_wgrad_jax_sm100`: [I, M] and [M, O], e4m3 scaled along
M or bf16, expert by expert, into a [E, I, O] fp32 out. Both are SM100-class only (B200,
B300) and marked experimental upstream; the layouts are `jaxmoe.ops.mx_grouped`'s.
Their kernels are compiled (CuTe DSL to a cubin inside a `CuteDSLRT_NvJaxCutlassCall`
custom call) when the program is lowered.

Without a GPU the wrappers would ask the CUDA runtime and driver while tracing. A
program compiled for Blackwell on a host without one (`jaxmoe.plan.targets`) runs them
inside `deviceless(target)`, which stands in for exactly these (named in `STAND_INS`,
and held by `tests/ops/test_cudnn_grouped.py`, which fails when a frontend release
renames or moves them):

- the compute capability the quant and wgrad wrappers check (`get_compute_capability`),
  and the device family they pick kernels by (`get_device_type`: "blackwell");
- `cutlass.utils.HardwareInfo().get_max_active_clusters(cluster size)`: the target's
  SMs // cluster size, an upper bound (the driver computes it from occupancy and may
  give fewer for large clusters); it sizes the persistent kernel's grid;
- the architecture CuTe compiles the kernel for (`CUTE_DSL_ARCH` and the DSL's cached
  copy of it): sm_100a for B200, sm_103a for B300.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import jax
import jax.numpy as jnp

FRONTEND = "1.32"  # the nvidia-cudnn-frontend release these stand-ins were read from
# where each stand-in is patched: (module, attribute)
STAND_INS = (("cudnn.gemm.cutedsl.grouped.quant.jax_api", "get_compute_capability"),
             ("cudnn.gemm.cutedsl.grouped.quant.jax_api", "get_device_type"),
             ("cudnn.gemm.cutedsl.grouped.wgrad.jax_api", "get_compute_capability"),
             ("cudnn.gemm.cutedsl.grouped.wgrad.jax_api", "get_device_type"),
             ("cutlass.utils", "HardwareInfo"))
INSTALL = 'pip install -e ".[cuda]" (or ".[gpu-compile]" to compile for a GPU without one)'


def _frontend():
    try:
        import cudnn
    except ImportError as e:
        raise RuntimeError("MXFP8 grouped expert GEMMs on Blackwell need cuDNN's frontend "
                           f"(nvidia-cudnn-frontend {FRONTEND}): {INSTALL}") from e
    return cudnn


def forward(a_MxK: jax.Array, sa_packed: jax.Array, b_ExNxK: jax.Array, sb_packed: jax.Array,
            ends_E: jax.Array, out_dtype) -> jax.Array:
    """[M, N] in out_dtype: group e's rows of a times b[e]^T (`jaxmoe.ops.mx_grouped`)."""
    cudnn = _frontend()
    alpha_E = jnp.ones((b_ExNxK.shape[0],), jnp.float32)
    return cudnn.grouped_gemm_quant_jax_forward(a_MxK, b_ExNxK, sa_packed, sb_packed, ends_E,
                                                alpha_E, d_dtype=out_dtype)["d_tensor"]


def weight_grad(a_IxM: jax.Array, sa_flat: jax.Array | None, b_MxO: jax.Array,
                sb_flat: jax.Array | None, ends_E: jax.Array) -> jax.Array:
    """[E, I, O] fp32: group e's columns of a times its rows of b; e4m3 with their scales,
    or bf16 (no scales)."""
    cudnn = _frontend()
    scales = {} if sa_flat is None else {"sfa_tensor": sa_flat, "sfb_tensor": sb_flat}
    return cudnn.grouped_gemm_wgrad_jax_sm100(a_IxM, b_MxO, ends_E, wgrad_dtype=jnp.float32,
                                              **scales)["wgrad_tensor"]


class _TargetHardware:
    """`cutlass.utils.HardwareInfo` for a GPU that is not there."""

    sms = 0  # set per target by `deviceless`

    def __init__(self, device_id: int = 0):
        pass

    def get_max_active_clusters(self, cluster_size: int, stream=None) -> int:
        return self.sms // cluster_size

    def get_device_multiprocessor_count(self) -> int:
        return self.sms


@contextlib.contextmanager
def deviceless(compute_capability: tuple[int, int], sms: int):
    """Traces and lowers the kernels for a Blackwell GPU of this compute capability and
    SM count without one (`STAND_INS`); restores everything after."""
    _frontend()
    import importlib

    import cutlass.base_dsl.dsl as cute_dsl

    major, minor = compute_capability
    arch = f"sm_{major}{minor}a"
    hardware = type("TargetHardware", (_TargetHardware,), {"sms": sms})
    values = {"get_compute_capability": lambda device_index=None: (major, minor),
              "get_device_type": lambda: "blackwell", "HardwareInfo": hardware}
    with contextlib.ExitStack() as stack:
        for module, name in STAND_INS:
            stack.enter_context(mock.patch.object(importlib.import_module(module), name,
                                                  values[name]))
        stack.enter_context(mock.patch.dict(os.environ, {"CUTE_DSL_ARCH": arch}))
        stack.enter_context(mock.patch.object(type(cute_dsl.BaseDSL._get_dsl().envar), "arch",
                                              arch))
        yield
