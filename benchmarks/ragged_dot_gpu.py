"""The grouped GEMM's implementations as XLA:GPU compiles them, without a GPU: XLA's
`lax.ragged_dot` and tokamax's Triton and Mosaic GPU kernels (`jaxmoe.ops.grouped_gemm`),
forward and both gradients of one GEMM, read off the optimized program.

    JAX_PLATFORMS=cpu python benchmarks/ragged_dot_gpu.py h100   # or h200, b300, ...

Per implementation: the kernels that do the products, their FLOPs with half the rows
routed (`program_flops` at routed_share 0.5: what a grouped kernel computes; a dense
lowering does every row against every group whatever the routing), the bytes of the
memory-bound kernels around them, the program's temporary memory, and the roofline
time at the target's datasheet rates. XLA's lowering shows what it is: a dense dot
over every group's weights (a contraction over E x I where a grouped GEMM has I).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxmoe.ops.grouped_gemm import grouped_matmul  # noqa: E402
from jaxmoe.ops.kernels import Kernels  # noqa: E402
from jaxmoe.plan.hlo import Program  # noqa: E402
from jaxmoe.plan.program_flops import program_flops  # noqa: E402
from jaxmoe.plan.roofline import Link, roofline  # noqa: E402
from jaxmoe.plan.targets import compile_deviceless, get_target, virtual_devices  # noqa: E402

E, C, I, O = 8, 16384, 2048, 4096  # experts (groups), rows, inputs, outputs


def _gemm(implementation: str, kernels: Kernels):
    if implementation == "xla-dense":
        return lambda x, w, rows: jax.lax.ragged_dot(x, w, rows)
    return lambda x, w, rows: grouped_matmul(x, w, rows, kernels, implementation)


def main(target: str) -> None:
    devices = virtual_devices(get_target(target), 1)
    kernels = Kernels.of(devices)
    replicated = NamedSharding(Mesh(devices, ("x",)), P())
    args = (jax.ShapeDtypeStruct((C, I), jnp.bfloat16, sharding=replicated),
            jax.ShapeDtypeStruct((E, I, O), jnp.bfloat16, sharding=replicated),
            jax.ShapeDtypeStruct((E,), jnp.int32, sharding=replicated))
    link = Link.of(get_target(target))
    print(f"| {target} | products | FLOPs (half the rows routed) | memory-bound bytes "
          "| temporaries | roofline |")
    print("|---|---|---|---|---|---|")
    for implementation in ("xla-dense", "triton", "mosaic"):
        gemm = _gemm(implementation, kernels)

        def loss(x, w, rows):
            with jax.named_scope("expert_gemms"):
                return jnp.sum(gemm(x, w, rows).astype(jnp.float32))

        try:
            with jax.default_device(devices[0]):
                lowered = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(*args).lower()
            compiled = compile_deviceless(lowered)
        except Exception as e:  # noqa: BLE001: the table says which implementation fails
            print(f"| {implementation} | fails: {type(e).__name__}: {str(e)[:120]} | | | | |")
            continue
        program = Program(compiled.as_text())
        program.routed_share = 0.5
        flops = program_flops(program)
        r = roofline(program, link)
        products = flops.kernels.get("expert_gemms", {})
        print(f"| {implementation} | {dict(products)} | {flops.total('expert_gemms'):.3e} "
              f"| {r.bytes('memory'):.3e} | {compiled.memory_analysis().temp_size_in_bytes / 1e9:.2f}"
              f" GB | {r.step_s * 1e3:.2f} ms |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "h100")
