#!/usr/bin/env bash
# GPU checks, for a machine with JAX (CUDA) installed and nothing else fetched.
# Run from the repository root: bash benchmarks/gpu.sh [OUT_DIR]
# Writes OUT_DIR/gpu_results.txt and one JSON per benchmark (default: ./gpu_out).
#
# Each check runs on its own under a time limit (8 minutes in all; 10 with 8+ GPUs),
# so one that fails or hangs costs only its own slot; the last line counts the
# failures. JAXMOE_GPU_SMOKE=1 runs every check at toy shapes: a check of this
# script itself, on CPU, before a GPU is spent on it.
set -uo pipefail
out="${1:-gpu_out}"
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
  || export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
smoke="${JAXMOE_GPU_SMOKE:-0}"
export JAXMOE_GPU_SMOKE="$smoke"
failed=()

check() {  # check NAME SECONDS COMMAND...: one check; a failure is recorded, not fatal
  local name=$1 limit=$2 rc
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout -k 10 "$limit" "$@"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "!! $name failed (exit $rc$([ "$rc" -eq 124 ] && echo ', time limit'))"
    failed+=("$name")
  fi
}

main() {
echo "== $(date -u) $(python3 -c 'import jax; print(jax.__version__, jax.devices())')"

# 1. the expert-parallel dispatchers (ragged_all_to_all + ragged_dot for `ragged`)
#    against the dense reference, values and gradients
check "dispatchers vs dense" 60 python3 - <<'PY'
import os, jax, jax.numpy as jnp
from jaxmoe.config import MeshConfig, MoEConfig
from jaxmoe.model.dispatch import dense_dispatch, get_dispatcher
from jaxmoe.model.router import route
from jaxmoe.model.experts import ExpertWeights
from jaxmoe.sharding import make_mesh

n = jax.device_count()
mesh = make_mesh(MeshConfig(data=1, expert=n))
T, D, F, E, K = 512 * n, 64, 128, 8 * n, 2
ks = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(ks[0], (T, D)); logits = jax.random.normal(ks[1], (T, E))
w = ExpertWeights(0.2 * jax.random.normal(ks[2], (E, D, 2 * F)), 0.2 * jax.random.normal(ks[3], (E, F, D)))
# XLA:CPU cannot compile ragged_all_to_all: the CPU smoke run leaves `ragged` out.
names = ("alltoall", "allgather") if jax.default_backend() == "cpu" else ("ragged", "alltoall", "allgather")
for name in names:
    cfg = MoEConfig(num_experts=E, top_k=K, capacity_factor=float(E), dispatcher=name)
    f = lambda x, w, d: jnp.sum(jnp.sin(d(x, route(logits, cfg), w, cfg, mesh).y_TxD))
    got = jax.jit(jax.value_and_grad(lambda x, w: f(x, w, get_dispatcher(name)), (0, 1)))(x, w)
    ref = jax.jit(jax.value_and_grad(lambda x, w: f(x, w, lambda *a: dense_dispatch(*a[:4])), (0, 1)))(x, w)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    print(f"{name:9s} vs dense on {n} device(s): max abs diff {err:.2e}")
PY

# 2. the expert GEMMs in MXFP8 against bf16 (forward + backward), native where supported
check "mxfp8 vs bf16 expert GEMMs" 45 python3 - <<'PY'
import dataclasses, os, time, jax, jax.numpy as jnp
from jaxmoe.config import MoEConfig
from jaxmoe.model.experts import ExpertWeights, expert_ffn
from jaxmoe.ops.mx import _native
E, C, D, F = (2, 64, 64, 64) if os.environ["JAXMOE_GPU_SMOKE"] == "1" else (8, 2048, 512, 1024)
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

if [ "$smoke" = 1 ]; then
  moe_shape=(--tokens 256 --d-model 64 --expert-hidden 64 --repeats 1)
  gpu_model=(--set model.d_model=64 --set model.num_heads=2 --set model.num_kv_heads=1
             --set model.mlp_hidden=128 --set moe.expert_hidden=32 --set train.batch_size=2
             --set train.seq_len=32 --repeats 1)
  matmul=(--matmul-size 128)
else
  moe_shape=(--repeats 10)
  gpu_model=(--set model.compute_dtype=bfloat16 --set model.d_model=2048 --set model.num_heads=16
             --set model.num_kv_heads=4 --set model.mlp_hidden=8192 --set moe.expert_hidden=1024
             --set train.batch_size=16 --set train.seq_len=2048)
  matmul=(--matmul-size 8192)
fi
overlap_on="--xla_gpu_enable_latency_hiding_scheduler=true"
overlap_off="--xla_gpu_enable_latency_hiding_scheduler=false --xla_gpu_disable_async_collectives=allreduce,allgather,reducescatter,collectivebroadcast,alltoall,collectivepermute"
if [ "$(python3 -c 'import jax; print(jax.default_backend())')" = cpu ]; then
  overlap_on="" overlap_off=""  # XLA:CPU rejects the GPU flags; the smoke run only checks the calls
fi

# 3. the MoE block vs a dense MLP of the same active FLOPs, E = 8, 32, 128
check "bench moe" 75 python3 -m jaxmoe.bench moe "${moe_shape[@]}" --json "$out/bench_moe.json"
# 4. a bf16 train step at GPU shapes: MFU against the measured bf16 matmul rate,
#    with XLA's collective/compute overlap on and off (it is not always a win)
check "bench step, overlap on" 75 env XLA_FLAGS="$overlap_on" \
  python3 -m jaxmoe.bench step "${gpu_model[@]}" "${matmul[@]}" --json "$out/bench_step_overlap.json"
check "bench step, overlap off" 75 env XLA_FLAGS="$overlap_off" \
  python3 -m jaxmoe.bench step "${gpu_model[@]}" "${matmul[@]}" --json "$out/bench_step_no_overlap.json"
# 5. 8 vs 128 experts of the same size in that bf16 model, with the update alone
check "bench experts" 150 python3 -m jaxmoe.bench experts "${gpu_model[@]}" \
  --json "$out/bench_experts.json"
# 6. with 8+ GPUs: ddp+EP vs fsdp, overlap on and off
if [ "$(python3 -c 'import jax; print(jax.device_count())')" -ge 8 ] && [ "$smoke" != 1 ]; then
  check "bench parallel, overlap on" 60 env XLA_FLAGS="$overlap_on" \
    python3 -m jaxmoe.bench parallel --json "$out/bench_parallel_overlap.json"
  check "bench parallel, overlap off" 60 env XLA_FLAGS="$overlap_off" \
    python3 -m jaxmoe.bench parallel --json "$out/bench_parallel_no_overlap.json"
fi

names=$(printf '%s; ' "${failed[@]}")
echo "== done $(date -u): ${#failed[@]} failed${failed:+: ${names%; }}"
[ "${#failed[@]}" -eq 0 ]
}

main 2>&1 | tee "$out/gpu_results.txt"
