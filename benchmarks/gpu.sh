#!/usr/bin/env bash
# GPU checks with pass/fail tolerances, then timed benchmarks, for a machine with
# JAX (CUDA) installed and nothing else fetched.
# Run from the repository root: bash benchmarks/gpu.sh [OUT_DIR]
# Writes OUT_DIR/gpu_results.txt (the log), OUT_DIR/table.txt (one line per check and
# benchmark: `name: figure (tolerance) PASS|FAIL|SKIPPED: reason`) and one JSON per
# benchmark (default OUT_DIR: ./gpu_out). Exits non-zero if any line says FAIL.
#
# The checks (benchmarks/gpu_checks.py, tolerances derived there) come first, each
# in its own process under its own time limit, so one that fails or hangs costs only
# its own slot. The benchmarks report figures and fail only if they crash. The whole
# script keeps to JAXMOE_GPU_BUDGET_S seconds (420; 540 with 8+ GPUs): a limit is cut
# to what is left, and what finds no time left is a FAIL (check) or SKIPPED (benchmark).
#
# JAXMOE_GPU_SMOKE=1: every check and benchmark at toy shapes on CPU (8 fake devices
# for the checks), a check of this script before a GPU is spent on it.
# JAXMOE_GPU_ONLY="name ...": run only these checks / benchmarks (e.g. to rerun one).
# JAXMOE_GPU_FAIL=name: spoil that check's computed answer, so that it must fail.
set -uo pipefail
out="${1:-gpu_out}"
mkdir -p "$out"
# this checkout's jaxmoe, whatever is installed (no install: the tests run this script)
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
smoke="${JAXMOE_GPU_SMOKE:-0}"
export JAXMOE_GPU_SMOKE="$smoke"
only=" ${JAXMOE_GPU_ONLY:-} "
table="$out/table.txt"
: > "$table"
scale=1
[ "$smoke" = 1 ] && scale=3  # a shared 2-core CPU compiles slower than a GPU host

wanted() { [ -z "${only// /}" ] || [[ "$only" == *" $1 "* ]]; }
why() { echo "exit $rc$([ "$rc" = 124 ] && echo ', time limit')"; }

limited() {  # limited SECONDS COMMAND...: under min(SECONDS x scale, budget left); sets rc, limit
  limit=$(( $1 * scale ))
  shift
  local left=$(( budget - SECONDS ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then rc=none; return; fi
  timeout -k 10 "$limit" "$@"
  rc=$?
}

check() {  # check NAME SECONDS: one check of gpu_checks.py, in its own process
  local name=$1
  wanted "$name" || return 0
  echo "== check $name"
  limited "$2" python3 benchmarks/gpu_checks.py "$name" --table "$table"
  if [ "$rc" = none ]; then
    echo "$name: - (-) FAIL: no time left of the ${budget} s budget" >> "$table"
  elif ! grep -q "^$name: " "$table"; then  # killed, or crashed before reporting
    echo "$name: - (limit ${limit} s) FAIL: $(why)" >> "$table"
  fi
}

bench() {  # bench NAME SECONDS COMMAND...: a timed benchmark, a FAIL only if it crashes
  local name=$1 t0=$SECONDS
  wanted "$name" || return 0
  shift
  echo "== bench $name"
  limited "$@"
  local line="$name: $(( SECONDS - t0 )) s (runs to the end)"
  if [ "$rc" = none ]; then
    echo "$name: - (-) SKIPPED: no time left of the ${budget} s budget" >> "$table"
  elif [ "$rc" = 0 ]; then
    echo "$line PASS" >> "$table"
  else
    echo "$line FAIL: $(why)" >> "$table"
  fi
}

main() {
echo "== $(date -u) $(python3 -c 'import jax; print(jax.__version__, jax.devices())')" \
  "$(python3 -c 'import importlib.metadata as m; print(*(f"{p} {m.version(p)}" for p in ("tokamax", "jax-triton", "triton")))' 2>/dev/null)"
# backend, devices, overlap_on, overlap_off (the GPU scheduler flags; empty on CPU)
eval "$(python3 benchmarks/gpu_checks.py env)" || { echo "!! gpu_checks.py env failed"; return 1; }
budget="${JAXMOE_GPU_BUDGET_S:-$([ "$devices" -ge 8 ] && echo 540 || echo 420)}"
[ "$smoke" = 1 ] && budget="${JAXMOE_GPU_BUDGET_S:-1200}"
echo "== $backend, $devices device(s), budget ${budget} s"

# 0. the JAX, CUDA plugin and kernels installed are the cuda extra's pinned releases
check stack 30
# 1. the offsets plan of `ragged` at 8+ ranks with skewed counts (exact)
check ragged_plan 30
# 2. each expert-parallel dispatcher, EP over every device, against `dense` on one:
#    outputs and gradients, uniform and skewed routing, fp32 and bf16
for d in ragged alltoall allgather; do
  check "${d}_fp32" 45
  check "${d}_bf16" 45
done
# 3. MXFP8 expert GEMMs against bf16 (forward and backward), with their time ratio
check mxfp8 45
# 4. the native block-scaled GEMM against the emulation, bit for bit (Blackwell+), and
#    cuDNN's grouped MXFP8 GEMMs (forward, both gradients) against their contract in XLA
check mxfp8_native 30
check mxfp8_grouped 60
# 5. a short bf16 run with `ragged` dispatch: the loss must fall
check train 120
# 6. the same steps with XLA's collective/compute overlap on and off: same losses
check overlap 150
# 7. the train check's step compiled here against XLA:GPU's deviceless plan (reported)
check compile_memory 90
# 8. the roofline's predicted step beside the measured one (reported), and the lowering
#    it assumes: exchanges asynchronous, MXFP8 weights quantised once per step (judged)
check roofline 90

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
# Benchmarks (one device each unless stated): figures, not checks.
# the MoE block vs a dense MLP of the same active FLOPs, E = 8, 32, 128
bench bench_moe 75 python3 -m jaxmoe.plan.bench moe "${moe_shape[@]}" --json "$out/bench_moe.json"
# a bf16 train step at GPU shapes: MFU against the measured bf16 matmul rate, with
# XLA's collective/compute overlap on and off (it is not always a win)
bench bench_step_overlap 75 env XLA_FLAGS="$overlap_on" python3 -m jaxmoe.plan.bench step \
  "${gpu_model[@]}" "${matmul[@]}" --json "$out/bench_step_overlap.json"
bench bench_step_no_overlap 75 env XLA_FLAGS="$overlap_off" python3 -m jaxmoe.plan.bench step \
  "${gpu_model[@]}" "${matmul[@]}" --json "$out/bench_step_no_overlap.json"
# 8 vs 128 experts of the same size in that bf16 model, with the update alone
bench bench_experts 150 python3 -m jaxmoe.plan.bench experts "${gpu_model[@]}" \
  --json "$out/bench_experts.json"
# with 8+ GPUs: ddp+EP vs fsdp, overlap on and off
if [ "$devices" -ge 8 ] && [ "$smoke" != 1 ]; then
  bench bench_parallel_overlap 60 env XLA_FLAGS="$overlap_on" \
    python3 -m jaxmoe.plan.bench parallel --json "$out/bench_parallel_overlap.json"
  bench bench_parallel_no_overlap 60 env XLA_FLAGS="$overlap_off" \
    python3 -m jaxmoe.plan.bench parallel --json "$out/bench_parallel_no_overlap.json"
fi

for name in $only; do  # a name that ran nothing must not pass quietly
  grep -q "^$name: " "$table" || echo "$name: - (-) FAIL: JAXMOE_GPU_ONLY, nothing ran" >> "$table"
done
echo "== table"
cat "$table"
local failed skipped
failed=$(grep -cE '\) FAIL(:|$)' "$table")
skipped=$(grep -cE '\) SKIPPED(:|$)' "$table")
echo "== done $(date -u) in ${SECONDS} s: $(wc -l < "$table") lines," \
  "$failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
}

main 2>&1 | tee "$out/gpu_results.txt"
