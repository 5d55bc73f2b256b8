"""cuDNN's grouped MXFP8 GEMMs compiled for B300 without one: the stand-ins
`jaxmoe.ops.cudnn_grouped.deviceless` takes are where this frontend release keeps them
(a release that moves or renames one fails here first), and the grouped MXFP8 layer's
forward, input gradient and weight gradient compile under `jax.grad` inside a
`shard_map` over 8 virtual B300s to three block-scaled kernel calls. Companion: the
same program lowered without the stand-ins fails while tracing."""

import importlib
import inspect
import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxmoe.ops import cudnn_grouped
from jaxmoe.ops.mx import quantize_weight
from jaxmoe.ops.mx_grouped import Options, aligned_ends, grouped_mx_linear
from jaxmoe.plan.targets import EXTRA, compile_deviceless, gpu_compiler_available, traced_on

if not gpu_compiler_available():  # part of the test extra: missing is a failure, not a skip
    pytest.fail(f"the GPU compiler is not installed: {EXTRA}", pytrace=False)

KERNEL_CALL = "CuteDSLRT_NvJaxCutlassCall"


def test_stand_ins_are_where_the_frontend_keeps_them():
    import cudnn
    import cutlass.base_dsl.dsl as cute_dsl
    import cutlass.utils

    assert cudnn.__version__.startswith(cudnn_grouped.FRONTEND + "."), cudnn.__version__
    originals = {}
    for module, name in cudnn_grouped.STAND_INS:
        originals[module, name] = getattr(importlib.import_module(module), name)
        assert callable(originals[module, name]), (module, name)
    envar = cute_dsl.BaseDSL._get_dsl().envar
    assert isinstance(inspect.getattr_static(type(envar), "arch"), property)
    quant = importlib.import_module(cudnn_grouped.STAND_INS[0][0])
    with cudnn_grouped.deviceless((10, 3), 148):
        assert quant.get_compute_capability() == (10, 3)
        assert quant.get_device_type() == "blackwell"
        assert cutlass.utils.HardwareInfo().get_max_active_clusters(2) == 74
        assert os.environ["CUTE_DSL_ARCH"] == "sm_103a" and envar.arch == "sm_103a"
    for (module, name), value in originals.items():  # restored
        assert getattr(importlib.import_module(module), name) is value
    assert isinstance(inspect.getattr_static(type(envar), "arch"), property)


E, M, I, O = 8, 2048, 256, 256  # per device: experts, packed rows, inputs, outputs


def _lowered(devices, options: Options, E: int = E):
    mesh = Mesh(devices, ("expert",))

    def loss(x, w, rows):
        y = grouped_mx_linear(x, quantize_weight(w), aligned_ends(rows), options)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    def per_device(x, w, rows):
        return jax.grad(loss, argnums=(0, 1))(x, w, rows)

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("expert"),) * 3,
                                 out_specs=(P("expert"), P("expert"))))
    n = len(devices)
    args = (jax.ShapeDtypeStruct((n * M, I), jnp.bfloat16),
            jax.ShapeDtypeStruct((n * E, I, O), jnp.float32),
            jax.ShapeDtypeStruct((n * E,), jnp.int32))
    return step.trace(*args).lower()


def test_forward_and_both_gradients_compile_for_b300():
    from jaxmoe.plan.targets import virtual_devices

    devices = virtual_devices("b300", 8)
    options = Options("cudnn", True, "ceil")
    with traced_on(devices[0]):
        hlo = compile_deviceless(_lowered(devices, options)).as_text()
    calls = [line for line in hlo.splitlines() if KERNEL_CALL in line and "custom-call(" in line]
    assert len(calls) == 3, calls
    results = sorted(line.split("=", 1)[1].split("custom-call(")[0].strip() for line in calls)
    # forward and input gradient [M, 256] in bf16, the weight gradient [E, I, O] in fp32
    assert results[0].startswith("(f32[8,256,256]") and results[1:] == [
        "bf16[2048,256]{1,0}"] * 2, results
    assert all("f8e4m3fn[" in line and "f8e8m0fnu[" in line for line in calls)


def test_without_the_stand_ins_the_trace_fails():
    from jaxmoe.plan.targets import virtual_devices

    devices = virtual_devices("b300", 8)
    # another expert count: the frontend keeps what it asked for a kernel it has built
    with pytest.raises(Exception, match="(?i)cuda|driver|libcuda"):
        _lowered(devices, Options("cudnn", True, "ceil"), E=E // 2)
