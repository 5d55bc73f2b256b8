"""Compile time of one small train step under given XLA flags, on 8 fake CPU devices.

    python benchmarks/compile_flags.py [--xla_flag=value ...]

The step is the ddp + expert-parallel (data 2 x expert 4, alltoall) step of
tests/step/test_spmd.py's model; the suite adds its XLA flags for compile speed, and
this measures what a flag buys. Prints the time to build and initialise, the first
step's call (compile included), three more steps, and the loss (which must not
change with a code-generation flag). Run each setting in a fresh process: the
persistent compilation cache must be off (it is, unless JAX_COMPILATION_CACHE_DIR
is set).
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           "--xla_backend_optimization_level=0 " + " ".join(sys.argv[1:]))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxmoe.parallel.sharding import make_mesh  # noqa: E402
from jaxmoe.step import build_steps  # noqa: E402
from test_spmd import _cfg  # noqa: E402

start = time.perf_counter()
cfg = _cfg({"data": 2, "expert": 4}, dispatcher="alltoall")
steps = build_steps(cfg, make_mesh(cfg.mesh, jax.devices()))
state = steps.init(jax.random.PRNGKey(0))
batch = jax.device_put(np.random.default_rng(0).integers(0, 256, (16, 17), dtype=np.int32),
                       steps.batch_sharding)
built = time.perf_counter()
state, metrics = steps.train_step(state, batch)
float(metrics["loss"])
first = time.perf_counter()
for _ in range(3):
    state, metrics = steps.train_step(state, batch)
loss = float(metrics["loss"])
done = time.perf_counter()
print(f"{' '.join(sys.argv[1:]) or 'LLVM level 0 only'}: init {built - start:.1f} s, first step "
      f"{first - built:.1f} s, 3 steps {done - first:.2f} s, loss {loss:.6f}")
