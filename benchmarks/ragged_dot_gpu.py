"""What XLA:GPU makes of `jax.lax.ragged_dot`, compiled without a GPU: the dots of the
forward and of both gradients, with their shapes, read off the optimized program.

    JAX_PLATFORMS=cpu python benchmarks/ragged_dot_gpu.py h100   # or b300, ...

A grouped GEMM contracts over K (forward) or N (input gradient) once per row; a
contraction over G x K means every row meets every group's weights.
"""

import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxmoe.plan.targets import compile_deviceless, get_target, virtual_devices  # noqa: E402

G, M, K, N = 8, 4096, 1024, 2048  # groups, rows, inputs, outputs


def main(target: str) -> None:
    replicated = NamedSharding(Mesh(virtual_devices(get_target(target), 1), ("x",)), P())
    args = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=replicated),
            jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16, sharding=replicated),
            jax.ShapeDtypeStruct((G,), jnp.int32, sharding=replicated))

    def loss(lhs, rhs, group_sizes):
        return jnp.sum(jax.lax.ragged_dot(lhs, rhs, group_sizes).astype(jnp.float32))

    for name, fn in [("forward", jax.lax.ragged_dot), ("gradients", jax.grad(loss, (0, 1)))]:
        text = compile_deviceless(jax.jit(fn).trace(*args).lower()).as_text()
        dots = re.findall(r"= (\w+\[[\d,]*\])\{[^}]*\} dot\(%(\S+), %(\S+)\)", text)
        params = dict(re.findall(r"%(\S+) = (\w+\[[\d,]*\])\{[^}]*\} parameter", text))
        for out, lhs, rhs in dots:
            print(f"{target} {name}: dot {params.get(lhs)} x {params.get(rhs)} -> {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "h100")
