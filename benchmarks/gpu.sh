#!/usr/bin/env bash
# GPU checks, for a machine with JAX (CUDA) installed and nothing else fetched.
# Run from the repository root: bash benchmarks/gpu.sh [OUT_DIR]
# Writes OUT_DIR/gpu_results.txt (default: ./gpu_out).
set -euo pipefail
out="${1:-gpu_out}"
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
  || export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
{
  echo "== $(date -u) $(python3 -c 'import jax; print(jax.__version__, jax.devices())')"
  # 1. the ragged dispatcher (ragged_all_to_all + ragged_dot) against the dense reference
  python3 - <<'PY'
import jax, jax.numpy as jnp, numpy as np
from jaxmoe.config import MeshConfig, MoEConfig
from jaxmoe.model.dispatch import dense_dispatch, get_dispatcher
from jaxmoe.model.experts import ExpertWeights
from jaxmoe.model.router import route
from jaxmoe.sharding import make_mesh

n = jax.device_count()
mesh = make_mesh(MeshConfig(data=1, expert=n))
T, D, F, E, K = 512 * n, 64, 128, 8 * n, 2
ks = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(ks[0], (T, D)); logits = jax.random.normal(ks[1], (T, E))
w = ExpertWeights(0.2 * jax.random.normal(ks[2], (E, D, 2 * F)), 0.2 * jax.random.normal(ks[3], (E, F, D)))
for name in ("ragged", "alltoall", "allgather"):
    cfg = MoEConfig(num_experts=E, top_k=K, capacity_factor=float(E), dispatcher=name)
    f = lambda x, w, d: jnp.sum(jnp.sin(d(x, route(logits, cfg), w, cfg, mesh).y_TxD))
    got = jax.jit(jax.value_and_grad(lambda x, w: f(x, w, get_dispatcher(name)), (0, 1)))(x, w)
    ref = jax.jit(jax.value_and_grad(lambda x, w: f(x, w, lambda *a: dense_dispatch(*a[:4])), (0, 1)))(x, w)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    print(f"{name:9s} vs dense on {n} device(s): max abs diff {err:.2e}")
PY
  # 2. the expert GEMMs in MXFP8 against bf16 (forward + backward), native where supported
  python3 - <<'PY'
import dataclasses, time, jax, jax.numpy as jnp
from jaxmoe.config import MoEConfig
from jaxmoe.model.experts import ExpertWeights, expert_ffn
from jaxmoe.ops.mx import _native
E, C, D, F = 8, 2048, 512, 1024
ks = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(ks[0], (E, C, D), jnp.bfloat16)
w = ExpertWeights(jax.random.normal(ks[1], (E, D, 2 * F)) / 23, jax.random.normal(ks[2], (E, F, D)) / 32)
base = MoEConfig(num_experts=E, expert_hidden=F)
times = {}
for name, cfg in [("bf16", base), ("mxfp8", dataclasses.replace(base, expert_precision="mxfp8"))]:
    step = jax.jit(jax.grad(lambda x, w: jnp.sum(expert_ffn(w, x, cfg).astype(jnp.float32)), (0, 1)))
    jax.block_until_ready(step(x, w))
    t0 = time.perf_counter()
    for _ in range(20):
        out = step(x, w)
    jax.block_until_ready(out)
    times[name] = (time.perf_counter() - t0) / 20
    print(f"expert GEMM fwd+bwd {name:6s} {times[name] * 1e3:.2f} ms")
print(f"mxfp8/bf16 time ratio {times['mxfp8'] / times['bf16']:.2f} (native block-scaled GEMM: {_native()})")
PY
  # 3. the MoE block vs dense MLP at the reference shape (fp32 on GPU)
  python3 -m jaxmoe.bench moe --repeats 10 --json "$out/bench_moe.json"
  # 4. a bf16 train step at GPU shapes: MFU against the measured bf16 matmul rate,
  #    with XLA's collective/compute overlap on and off (it is not always a win)
  gpu_model=(--set model.compute_dtype=bfloat16 --set model.d_model=2048 --set model.num_heads=16
             --set model.num_kv_heads=4 --set model.mlp_hidden=8192 --set moe.expert_hidden=1024
             --set train.batch_size=16 --set train.seq_len=2048)
  overlap_off="--xla_gpu_enable_latency_hiding_scheduler=false --xla_gpu_disable_async_collectives=allreduce,allgather,reducescatter,collectivebroadcast,alltoall,collectivepermute"
  XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true" \
    python3 -m jaxmoe.bench step "${gpu_model[@]}" --matmul-size 8192 --json "$out/bench_step_overlap.json"
  XLA_FLAGS="$overlap_off" \
    python3 -m jaxmoe.bench step "${gpu_model[@]}" --matmul-size 8192 --json "$out/bench_step_no_overlap.json"
  # 5. 8 vs 128 experts of the same size in that bf16 model
  python3 -m jaxmoe.bench experts "${gpu_model[@]}" --json "$out/bench_experts.json"
  # 6. with 8+ GPUs: ddp+EP vs fsdp, overlap on and off
  if [ "$(python3 -c 'import jax; print(jax.device_count())')" -ge 8 ]; then
    XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true" \
      python3 -m jaxmoe.bench parallel --json "$out/bench_parallel_overlap.json"
    XLA_FLAGS="$overlap_off" python3 -m jaxmoe.bench parallel --json "$out/bench_parallel_no_overlap.json"
  fi
} 2>&1 | tee "$out/gpu_results.txt"
