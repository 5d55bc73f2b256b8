"""GPU checks with pass/fail tolerances: python3 benchmarks/gpu_checks.py CHECK [--table FILE]

One function per check. Each computes one figure, compares it with a tolerance
derived (in its docstring or a comment) from the arithmetic involved, and reports one line

    name: figure (tolerance) PASS|FAIL|SKIPPED: reason

which `main` prints, appends to --table, and turns into the exit status (1 on FAIL).
`benchmarks/gpu.sh` runs each check in its own process under its own time limit.

JAXMOE_GPU_SMOKE=1: toy shapes on 8 fake CPU devices (set here before JAX starts),
so the expert-parallel checks span ranks. JAXMOE_GPU_FAIL=NAME perturbs check
NAME's computed answer so that it must fail (a test of the checks themselves).
`python3 benchmarks/gpu_checks.py env` prints shell assignments gpu.sh reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if os.environ.get("JAXMOE_GPU_SMOKE") == "1":
        from jaxmoe.runtime.fake_devices import cpu_devices_env  # starts no JAX
        os.environ.update(cpu_devices_env(os.environ, 8))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxmoe.config import (MeshConfig, MoEConfig, config_from_dict, load_config,  # noqa: E402
                           override_config)
from jaxmoe.model.experts import ExpertWeights, expert_ffn  # noqa: E402
from jaxmoe.model.router import Routing, route  # noqa: E402
from jaxmoe.ops import mx  # noqa: E402
from jaxmoe.ops.kernels import Kernels  # noqa: E402
from jaxmoe.parallel.layout import dispatch_on_mesh  # noqa: E402
from jaxmoe.parallel.sharding import BATCH_AXES, make_mesh  # noqa: E402

U_FP32, U_BF16, U_E4M3 = 2.0 ** -24, 2.0 ** -8, 2.0 ** -4  # unit roundoffs (half an ulp at 1)
FAIL_ENV = "JAXMOE_GPU_FAIL"
# The collective/compute overlap flags the benchmarks and the overlap check compare.
OVERLAP_FLAGS = {
    "on": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "off": "--xla_gpu_enable_latency_hiding_scheduler=false --xla_gpu_disable_async_collectives="
           "allreduce,allgather,reducescatter,collectivebroadcast,alltoall,collectivepermute",
}
# No autotuning (kernels chosen by fixed heuristics, not by timing) and deterministic
# scatters: each op's arithmetic is then fixed, whatever the schedule.
DETERMINISTIC = "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"  # off in the overlap check's parent, which
# holds the GPU while its two children run (each takes the usual 75% of memory)


@dataclass(frozen=True)
class Result:
    name: str
    status: str  # PASS, FAIL or SKIPPED
    figure: str = "-"
    tolerance: str = "-"
    note: str = ""

    def line(self) -> str:
        tail = f": {self.note}" if self.note else ""
        return f"{self.name}: {self.figure} ({self.tolerance}) {self.status}{tail}"


def judged(name: str, figure: float, tol: float, note: str = "", fmt: str = ".2e") -> Result:
    ok = figure <= tol  # NaN fails
    return Result(name, "PASS" if ok else "FAIL", f"{figure:{fmt}}", f"<= {tol:{fmt}}", note)


def perturbed(name: str) -> bool:
    """True where JAXMOE_GPU_FAIL names this check: its computed answer is then spoiled."""
    return os.environ.get(FAIL_ENV) == name


def rel_err(got, want) -> float:
    """||got - want||_F / ||want||_F, in float64."""
    g, w = (np.asarray(a, np.float64) for a in (got, want))
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-300))


def on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def cpu_cannot_run_ragged(e: Exception) -> str | None:
    """The reason to skip, where this is XLA:CPU lacking ragged_all_to_all (else None:
    any other error, and every error on a GPU, is a failure)."""
    text = str(e)
    if on_cpu() and "ragged" in text.lower():
        return "XLA:CPU cannot run ragged_all_to_all here: " + text.strip().splitlines()[0][:160]
    return None


# ---------------------------------------------------------------- dispatchers vs dense

DISPATCH_NAMES = [f"{d}_{t}" for d in ("ragged", "alltoall", "allgather") for t in ("fp32", "bf16")]
SKEW = 0.9  # share of tokens whose every copy goes to experts [0, K), all on rank 0


def dispatch_problem(toy: bool):
    """(cfg sizes, x, routings {uniform, skewed}, weights, cotangent), drawn with numpy
    (no compiles); E / R >= K, so a skewed token's K copies all land on rank 0."""
    R = jax.device_count()
    K = 4
    E = max(8, K * R)
    Tl, D, F = (64, 32, 64) if toy else (4096, 256, 512)
    T = Tl * R
    cfg = MoEConfig(num_experts=E, top_k=K, expert_hidden=F)
    rng = np.random.default_rng(0)
    x, ct = rng.standard_normal((2, T, D), np.float32)
    logits = rng.standard_normal((T, E), np.float32)
    skewed = np.zeros((T, 1), bool)
    skewed[rng.permutation(T)[:int(SKEW * T)]] = True
    bias = np.where(skewed & (np.arange(E) < K), 10.0, 0.0).astype(np.float32)
    routes = jax.jit(lambda a, b: (route(a, cfg), route(b, cfg)))(logits, logits + bias)
    routings = {k: jax.tree.map(np.asarray, r) for k, r in zip(("uniform", "skewed"), routes)}
    w = ExpertWeights(rng.standard_normal((E, D, 2 * F), np.float32) / np.float32(math.sqrt(D)),
                      rng.standard_normal((E, F, D), np.float32) / np.float32(math.sqrt(F)))
    return cfg, x, routings, w, ct


@functools.lru_cache
def dispatch_vjp(name: str, cfg: MoEConfig, mesh):
    """One program: (y, dropped, (dx, dgates, dw)) of <y, ct> through dispatcher `name`."""
    def run(x, expert_TxK, gate_TxK, w, ct):
        def f(x, g, w):
            out = dispatch_on_mesh(x, Routing(expert_TxK, g, None, None, None), w,
                                   dataclasses.replace(cfg, dispatcher=name), mesh)
            return out.y_TxD, out.dropped
        y, pull, dropped = jax.vjp(f, x, gate_TxK, w, has_aux=True)
        return y, dropped, pull(ct)
    return jax.jit(run)


def dispatch_tolerance(dtype: str, n_max: int) -> float:
    """Largest allowed ||EP - dense||_F / ||dense||_F over outputs and gradients.

    fp32: both sides sum the same products, in other orders (grouped vs dense GEMMs,
    scatter-adds). An n-term sum's rounding error is ~sqrt(n) u relative for
    incoherent signs (u = 2^-24); a chain of ~4 GEMMs (forward 2, backward 2) with
    contractions up to n_max terms, times 8 for margin: 32 sqrt(n_max) u.
    bf16 (fp32 accumulation): each side rounds to bf16 at up to m = 8 points along a
    path (GEMM outputs, silu, products, gating, the K-sum; likewise backward), not at
    the same points (dense rounds each token's gated sum once, the EP forms each
    copy's product). A rounding adds relative error of RMS u / sqrt(3) (u = 2^-8);
    independent errors of both sides add in quadrature: sqrt(2m / 3) u = 2.3 u, times
    3 for margin: 6.9 u = 0.027.
    """
    if dtype == "fp32":
        return 32 * math.sqrt(n_max) * U_FP32
    return 3 * math.sqrt(2 * 8 / 3) * U_BF16


def check_dispatch(name: str, toy: bool) -> Result:
    """`ragged`, `alltoall` or `allgather` (EP over every device) against `dense` on
    one device: outputs and gradients w.r.t. x, gates and weights, for uniform and
    skewed routing. Dropless (alltoall's capacity covers every copy)."""
    dispatcher, dtype = name.split("_")
    cfg0, x, routings, w, ct = dispatch_problem(toy)
    R, (T, D) = jax.device_count(), x.shape
    E, K, F = cfg0.num_experts, cfg0.top_k, cfg0.expert_hidden
    cfg = MoEConfig(num_experts=E, top_k=K, expert_hidden=F, dispatcher=dispatcher,
                    capacity_factor=E / K)  # C = Tl: a device's copies always fit
    dt = jnp.float32 if dtype == "fp32" else jnp.bfloat16
    x, ct = x.astype(dt), ct.astype(dt)
    mesh = make_mesh(MeshConfig(data=1, expert=R))
    tokens, experts = NamedSharding(mesh, P(BATCH_AXES)), NamedSharding(mesh, P("expert"))
    errs = {}
    # fp32 at full precision: no TF32 on either side, so only the order of sums differs
    precision = "highest" if dtype == "fp32" else "default"
    with jax.default_matmul_precision(precision):
        ep, dense = dispatch_vjp(dispatcher, cfg, mesh), dispatch_vjp("dense", cfg, None)
        for kind, r in routings.items():
            args = (x, r.expert_TxK, r.gate_TxK, w, ct)
            want = dense(*args)
            placed = [jax.device_put(a, s) for a, s in
                      zip(args, (tokens, tokens, tokens, experts, tokens))]
            try:
                got = ep(*placed)
            except Exception as e:  # noqa: BLE001  (a GPU error fails below, re-raised)
                reason = cpu_cannot_run_ragged(e) if dispatcher == "ragged" else None
                if reason:
                    return Result(name, "SKIPPED", note=reason)
                raise
            y = np.array(got[0], np.float32)
            if perturbed(name):  # a routing bug: token pairs swapped in an eighth of the rows
                y[:T // 8] = y[:T // 8].reshape(-1, 2, D)[:, ::-1].reshape(-1, D)
            leaves = [y] + jax.tree.leaves(got[2])
            errs[kind] = max(rel_err(g, w_) for g, w_ in
                             zip(leaves, [want[0]] + jax.tree.leaves(want[2])))
            if int(got[1]):
                return Result(name, "FAIL", note=f"{int(got[1])} copies dropped ({kind})")
    expert_N = routings["skewed"].expert_TxK.ravel()
    hot, share = np.mean(expert_N < K), np.mean(expert_N < E // R)
    if hot < SKEW:  # the skewed case must really load experts [0, K), on rank 0
        return Result(name, "FAIL", note=f"skewed routing sent {hot:.2f} of copies to experts < K")
    # longest contraction: D, 2F, or an expert's rows in the weight gradient (<= T)
    tol = dispatch_tolerance(dtype, max(D, 2 * F, T))
    notes = (f"uniform {errs['uniform']:.1e}, skewed {errs['skewed']:.1e} "
             f"(rank 0 gets {share:.2f} of copies); R={R}, E={E}, K={K}, T={T}")
    return judged(name, max(errs.values()), tol, notes)


def check_ragged_plan(toy: bool) -> Result:
    """The ragged offsets plan at R = max(devices, 8) ranks with skewed counts, run
    through ragged_all_to_all's documented semantics on the host: every receiver's
    [El, C] buffer must hold, for each local expert, the first C of its rows (sources
    in rank order), the overflow must be counted as dropped, and the reverse exchange
    must restore every kept row of every sender. Exact: the figure is the number of
    misplaced rows and miscounted drops. Runs on one device, so a 1-GPU machine
    still checks the multi-rank layout."""
    from jaxmoe.parallel.ep_dispatch import ragged_plan

    R, El = max(jax.device_count(), 8), 2
    E, C = R * El, 64
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 4, size=(R, E))
    counts[:, :El] += rng.integers(20, 40, size=(R, El))  # skew: rank 0's experts overflow C
    counts[2, :] = 0  # a rank that sends nothing
    counts[:, El + 1] = 0  # an expert nobody picks
    plan_at = jax.jit(lambda r: ragged_plan(jnp.asarray(counts), r, El, C))
    plans = [jax.tree.map(np.asarray, plan_at(jnp.int32(r))) for r in range(R)]
    N = int(counts.sum(1).max())
    sent = []  # rows tagged (source, expert, index), sorted by expert, padded with -1
    for s in range(R):
        rows = [(s, e, i) for e in range(E) for i in range(counts[s, e])]
        sent.append(np.array(rows + [(-1, -1, -1)] * (N - len(rows))).reshape(N, 3))

    def exchange(operands, out_rows, args):
        out = [np.full((out_rows, 3), -1) for _ in range(R)]
        for src in range(R):
            in_off, size, out_off, _ = args[src]
            for i in range(E):
                dst = i // El
                rows = operands[src][in_off[i]:in_off[i] + size[i]]
                out[dst][out_off[i]:out_off[i] + size[i]] = rows
        return out

    recv = exchange(sent, El * C, [p.forward for p in plans])
    back = exchange(recv, N, [p.backward for p in plans])
    bad = 0
    for r in range(R):
        want = np.full((El * C, 3), -1)
        for le in range(El):
            rows = [(s, r * El + le, i) for s in range(R) for i in range(counts[s, r * El + le])]
            want[le * C:le * C + min(C, len(rows))] = np.array(rows[:C]).reshape(-1, 3)
        bad += int(np.sum(np.any(recv[r] != want, axis=1)))
        returned = back[r][:, 0] != -1
        bad += int(np.sum(np.any(back[r][returned] != sent[r][returned], axis=1)))
        bad += abs(int(counts[r].sum() - returned.sum()) - int(plans[r].dropped))
    bad += abs(sum(int(p.dropped) for p in plans) - int(np.maximum(counts.sum(0) - C, 0).sum()))
    if perturbed("ragged_plan"):
        bad += 1
    hot = counts[:, :El].sum()
    return judged("ragged_plan", bad, 0, f"R={R}, C={C}: rank 0's experts keep "
                  f"{El * C / hot:.2f} of their {hot} rows", fmt="d")


# ---------------------------------------------------------------- MXFP8


def mxfp8_problem(toy: bool):
    E, C, D, F = (2, 64, 64, 64) if toy else (8, 2048, 512, 1024)
    rng = np.random.default_rng(1)
    x, ct = rng.standard_normal((2, E, C, D), np.float32).astype(jnp.bfloat16)
    w = ExpertWeights(rng.standard_normal((E, D, 2 * F), np.float32) / np.float32(math.sqrt(D)),
                      rng.standard_normal((E, F, D), np.float32) / np.float32(math.sqrt(F)))
    return x, w, ct, MoEConfig(num_experts=E, expert_hidden=F)


@functools.lru_cache
def ffn_vjp(cfg: MoEConfig):
    """(y, dx, dw) of <expert_ffn(w, x), ct>, compiled once per config."""
    def f(x, w, ct):
        y, pull = jax.vjp(lambda x, w: expert_ffn(w, x, cfg), x, w)
        return (y,) + pull(ct)
    return jax.jit(f)


def check_mxfp8(toy: bool) -> Result:
    """expert_ffn with MXFP8 expert GEMMs against bf16 ones, forward and backward.

    Bound: each quantised operand element is off by <= 2^-4 of itself (e4m3 normals;
    a subnormal's absolute error 2^-10 X is smaller still against its block's max).
    With incoherent signs a quantised GEMM's output is then off by <= sqrt(2) 2^-4 of
    its norm (two operands, root-sum-square), and an array's error is at most the sum
    over the quantised GEMM outputs it is built from: y from gate and up (multiplied)
    and the down GEMM, 3; dx from gate, up, dy w2^T and dh w1^T, 4; dw_gate_up =
    x^T dh from gate, up and dy w2^T, 3; dw_down = act^T dy from gate and up, 2
    (bf16's own 2^-8 is negligible). The figure is the worst error as a fraction of
    its array's bound. And MXFP8 must really quantise: e4m3 rounds each operand by
    >= 2^-5 / sqrt(3) RMS, so y must differ from bf16 by more than 4 x 2^-8.
    Time ratio: reported only.
    """
    x, w, ct, base = mxfp8_problem(toy)
    cfg = MoEConfig(num_experts=base.num_experts, expert_hidden=base.expert_hidden,
                    expert_precision="mxfp8")
    runs = {"bf16": functools.partial(ffn_vjp(base), x, w, ct),
            "mxfp8": functools.partial(ffn_vjp(cfg), x, w, ct)}
    outs = {k: jax.tree.map(lambda a: np.array(a, np.float32), run()) for k, run in runs.items()}
    if perturbed("mxfp8"):  # a scale off by one binade in the first expert's output
        outs["mxfp8"][0][0] *= 2
    names, terms = ("y", "dx", "dw_gate_up", "dw_down"), (3, 4, 3, 2)
    errs = [rel_err(a, b) for a, b in zip(jax.tree.leaves(outs["mxfp8"]),
                                          jax.tree.leaves(outs["bf16"]))]
    bounds = [t * math.sqrt(2) * U_E4M3 for t in terms]
    parts = [f"{n} {e:.3f}/{b:.3f}" for n, e, b in zip(names, errs, bounds)]
    if errs[0] <= 4 * U_BF16:
        return Result("mxfp8", "FAIL", note=f"y within {errs[0]:.4f} of bf16: not quantised")
    worst = max(e / b for e, b in zip(errs, bounds))
    secs = {}
    for k, run in runs.items():
        reps = 3 if toy else 20
        jax.block_until_ready(run())
        t0 = time.perf_counter()
        for _ in range(reps):
            out = run()
        jax.block_until_ready(out)
        secs[k] = (time.perf_counter() - t0) / reps
    note = (", ".join(parts) + f"; time mxfp8/bf16 {secs['mxfp8'] / secs['bf16']:.2f} "
            f"({secs['bf16'] * 1e3:.2f} ms bf16, native GEMM: {Kernels.default().native_mxfp8})")
    return judged("mxfp8", worst, 1.0, note, fmt=".3f")


def exact_operands(B: int = 2, M: int = 64, N: int = 64, K: int = 256):
    """MXFP8 operands whose GEMM every accumulation order gets exactly right: integer
    elements in [-4, 4] with one +-16 per block of 32 (at different positions in a and
    b), so each block's scale is 2^-4, quantisation is exact, products are integers
    <= 64 and every partial sum an integer < 2^13 (exact even in a 14-bit accumulator).
    Returns (a [B, M, K], b [B, N, K], exact a b^T as float64)."""
    rng = np.random.default_rng(3)
    a = rng.integers(-4, 5, size=(B, M, K)).astype(np.float32)
    b = rng.integers(-4, 5, size=(B, N, K)).astype(np.float32)
    a[..., 0::32] = 16 * rng.choice([-1, 1], size=a[..., 0::32].shape)
    b[..., 1::32] = 16 * rng.choice([-1, 1], size=b[..., 1::32].shape)
    return a, b, np.einsum("bmk,bnk->bmn", a.astype(np.float64), b.astype(np.float64))


def emulated_bmm(a, b):
    """The emulation's GEMM: quantise, dequantise, fp32 einsum (mx.py's fallback)."""
    return jnp.einsum("bmk,bnk->bmn", mx.fake_quantize(a), mx.fake_quantize(b),
                      preferred_element_type=jnp.float32, precision="highest")


def check_mxfp8_native(toy: bool) -> Result:
    """Native block-scaled GEMM (mx.mx_bmm where the device has one) against the
    emulation, bit for bit, on `exact_operands` (where any correct GEMM is exact, so any
    bit that differs is a wrong scale, layout or operand). Figure: differing elements."""
    if not Kernels.default().native_mxfp8:
        d = jax.devices()[0]
        cc = getattr(d, "compute_capability", None)
        where = d.device_kind + (f", compute capability {cc}" if cc else "")
        return Result("mxfp8_native", "SKIPPED",
                      note=f"no native block-scaled GEMM on this device ({where})")
    a, b, exact = exact_operands()
    native = np.asarray(jax.jit(lambda a, b: mx.mx_bmm(a, b, jnp.float32, native=True))(a, b))
    emulated = np.asarray(jax.jit(emulated_bmm)(a, b))
    if perturbed("mxfp8_native"):
        native.flat[0] = np.nextafter(native.flat[0], np.inf)
    differ = int(np.sum(native != emulated)) + int(np.sum(emulated != exact))
    return judged("mxfp8_native", differ, 0, f"{native.size} elements, K={a.shape[-1]}", fmt="d")


def exact_grouped_operands(rows=(300, 0, 1, 700), I: int = 256, O: int = 256):
    """Packed rows (each expert's from a multiple of 256, zeros up to it) and weights whose
    grouped MXFP8 GEMMs are exact in any accumulation order: integers in [-4, 4] with one
    +-16 in every block of 32, along both axes of each array (at (r + c) % 32 == 0), so
    every block quantises exactly (its scale 2^-4, or 2^-6 where padding zeros cut the
    +-16 off) and every sum is an integer below 2^24. Returns (x [M, I], w [E, I, O],
    dy [M, O], group ends)."""
    from jaxmoe.ops.mx_grouped import aligned_ends, aligned_rows
    rng = np.random.default_rng(4)

    def exact(*shape):
        a = rng.integers(-4, 5, size=shape).astype(np.float32)
        r, c = np.meshgrid(np.arange(shape[-2]), np.arange(shape[-1]), indexing="ij")
        return np.where((r + c) % 32 == 0, 16 * rng.choice([-1, 1], size=shape), a)

    ends = np.asarray(aligned_ends(jnp.asarray(rows)))
    M = aligned_rows(sum(rows), len(rows))
    x, dy = exact(M, I), exact(M, O)
    start = 0
    for n, end in zip(rows, ends):
        x[start + n:end] = dy[start + n:end] = 0.0
        start = end
    x[ends[-1]:] = dy[ends[-1]:] = 0.0
    return x, exact(len(rows), I, O).astype(np.float32), dy, ends.astype(np.int32)


def check_mxfp8_grouped(toy: bool) -> Result:
    """cuDNN's grouped MXFP8 GEMMs (`jaxmoe.ops.mx_grouped`, "cudnn": forward, input and
    weight gradient) against the same contract in XLA ("reference") on this GPU, on
    `exact_grouped_operands`, where any correct kernel is exact: every bit that differs
    is a wrong scale, layout, group end or operand. Figure: differing elements."""
    from jaxmoe.ops.mx_grouped import Options, grouped_mx_linear
    kernels = Kernels.default()
    if kernels.grouped_gemm(MoEConfig(expert_precision="mxfp8"), 256) != "cudnn":
        d = jax.devices()[0]
        return Result("mxfp8_grouped", "SKIPPED",
                      note=f"no cuDNN grouped MXFP8 GEMM on {d.device_kind} (Blackwell and "
                           "nvidia-cudnn-frontend)")
    x, w, dy, ends = exact_grouped_operands()
    outs = {}
    for impl in ("cudnn", "reference"):
        options = Options(impl, True, "ceil")

        def f(x_, w_, impl_options=options):
            return grouped_mx_linear(x_, mx.quantize_weight(w_), jnp.asarray(ends),
                                     impl_options)

        y, vjp = jax.vjp(jax.jit(f), jnp.asarray(x), jnp.asarray(w))
        outs[impl] = [np.asarray(a, np.float64) for a in (y, *vjp(jnp.asarray(dy)))]
    if perturbed("mxfp8_grouped"):
        outs["cudnn"][2].flat[0] += 1.0
    real = np.zeros(len(x), bool)
    start = 0
    for n, end in zip((300, 0, 1, 700), ends):
        real[start:start + n] = True
        start = end
    got, want = outs["cudnn"], outs["reference"]
    differ = [int(np.sum(got[0][real] != want[0][real])), int(np.sum(got[1][real] != want[1][real])),
              int(np.sum(got[2] != want[2]))]
    note = (f"y {differ[0]}, dx {differ[1]}, dw {differ[2]} of {real.sum()} rows x "
            f"{x.shape[1]}, {len(ends)} experts")
    return judged("mxfp8_grouped", sum(differ), 0, note, fmt="d")


# ---------------------------------------------------------------- training

# Uniform prediction over 256 bytes costs ln 256 = 5.55 nats; the training corpus
# (the stdlib's source) has a byte-unigram entropy of 3.26 nats, so learning byte
# frequencies alone lowers the loss by ~2.3 nats. A working step must recover at
# least 1 nat of that within the short run.
LOSS_FALL = 1.0


def train_config(toy: bool, steps: int, dispatcher: str = "ragged"):
    if toy:
        return config_from_dict({
            "model": {"d_model": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                      "mlp_hidden": 64},
            "moe": {"num_experts": 16, "top_k": 2, "expert_hidden": 32, "dispatcher": dispatcher,
                    "capacity_factor": 2.0},
            "mesh": {"data": 1, "expert": jax.device_count()},
            "train": {"steps": steps, "batch_size": 16, "seq_len": 32},
            "optimizer": {"learning_rate": 1e-2, "warmup_steps": min(3, steps - 1),
                          "schedule": "constant"},
        })
    # configs/gpu1_small.yaml (bf16, ragged, 32 experts top-4, shared expert), narrower
    # and shallower so that it compiles and runs in well under a minute
    return load_config(ROOT / "configs" / "gpu1_small.yaml", [
        "model.d_model=512", "model.num_layers=4", "model.num_heads=8", "model.mlp_hidden=2048",
        "moe.expert_hidden=512", "moe.shared_expert_hidden=512", f"moe.dispatcher={dispatcher}",
        "mesh.data=1", f"mesh.expert={jax.device_count()}", f"train.steps={steps}",
        "train.batch_size=16", "train.seq_len=512", "train.remat=none",
        "optimizer.learning_rate=3e-3", f"optimizer.warmup_steps={min(5, steps - 1)}",
        "optimizer.schedule=constant"])


@functools.lru_cache
def train_losses(cfg, runs: int = 1) -> tuple[tuple[float, ...], ...]:
    """Per-step training cross-entropy of `cfg` from a fresh init on the stdlib corpus,
    `runs` times over with one compiled step."""
    from jaxmoe.data.batches import BatchIterator
    from jaxmoe.data.corpus import load_corpus
    from jaxmoe.step import build_steps

    t = cfg.train
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    corpus = load_corpus("stdlib", None, cfg.model.vocab_size, t.seq_len)
    out = []
    for _ in range(runs):
        batches = BatchIterator(corpus.train, t.batch_size, t.seq_len, seed=t.seed)
        state, ces = steps.init(jax.random.PRNGKey(t.seed)), []
        for _ in range(t.steps):
            state, metrics = steps.train_step(state, jax.device_put(next(batches),
                                                                    steps.batch_sharding))
            ces.append(metrics["ce"])
        out.append(tuple(float(c) for c in jax.device_get(ces)))
    return tuple(out)


def check_train(toy: bool) -> Result:
    """A short run from scratch with the `ragged` dispatcher (bf16 on a GPU): the mean
    training loss of the last 5 steps must sit LOSS_FALL nats under the first step's.
    Where XLA:CPU cannot run `ragged`, the run uses `alltoall` and says so."""
    n = 30 if toy else 60
    used, note = "ragged", ""
    try:
        cfg = train_config(toy, n, "ragged")
        (losses,) = train_losses(cfg)
    except Exception as e:  # noqa: BLE001
        reason = cpu_cannot_run_ragged(e)
        if not reason:
            raise
        used, note = "alltoall", f"; ran alltoall since {reason}"
        cfg = train_config(toy, n, "alltoall")
        (losses,) = train_losses(cfg)
    if perturbed("train"):  # a step that does not learn
        losses = (losses[0],) * len(losses)
    fall = losses[0] - float(np.mean(losses[-5:]))
    detail = (f"loss {losses[0]:.3f} -> {np.mean(losses[-5:]):.3f} over {n} steps, "
              f"{used}, {cfg.model.compute_dtype}{note}")
    return Result("train", "PASS" if fall >= LOSS_FALL else "FAIL", f"fall {fall:.3f}",
                  f">= {LOSS_FALL:.3f}", detail)


def overlap_config(toy: bool, steps: int):
    """The train check's model, with attention in plain JAX blocks: cuDNN's fused
    attention backward need not be run-to-run deterministic under XLA's flags."""
    cfg = train_config(toy, steps)
    return override_config(cfg, [f"model.attention_block={min(128, cfg.train.seq_len)}"])


def check_overlap(toy: bool) -> Result:
    """The same few train steps with the collective-overlap flags on and off, each in
    its own process (XLA reads its flags once): the losses must agree bit for bit.
    A scheduler only reorders independent ops, and under DETERMINISTIC every op's
    arithmetic is fixed, so any difference is a changed computation. Each process
    runs the steps twice, to show that premise: a repeat must match bit for bit too."""
    if on_cpu():
        return Result("overlap", "SKIPPED",
                      note="XLA:CPU rejects the GPU scheduler flags (--xla_gpu_*)")
    losses, parent = {}, {k: v for k, v in os.environ.items() if k != PREALLOCATE}
    for mode, flags in OVERLAP_FLAGS.items():
        env = {**parent, "XLA_FLAGS": " ".join(
            f for f in (os.environ.get("XLA_FLAGS", ""), flags, DETERMINISTIC) if f)}
        proc = subprocess.run([sys.executable, __file__, "losses", "--steps", "5"] +
                              (["--toy"] if toy else []), env=env, capture_output=True, text=True)
        if proc.returncode:
            return Result("overlap", "FAIL", note=f"overlap {mode}: exit {proc.returncode}: "
                          + (proc.stderr.strip().splitlines() or ["?"])[-1][:200])
        first, repeat = json.loads(proc.stdout.strip().splitlines()[-1])
        if first != repeat:
            return Result("overlap", "FAIL", note=f"overlap {mode}: a repeat of the same "
                          f"steps differs ({first} vs {repeat}): not deterministic")
        losses[mode] = first
    if perturbed("overlap"):
        losses["off"][-1] = float(np.nextafter(np.float32(losses["off"][-1]), np.float32(np.inf)))
    diff = max(abs(a - b) for a, b in zip(losses["on"], losses["off"]))
    return judged("overlap", diff, 0.0, "losses " + ", ".join(f"{v:.6f}" for v in losses["on"]))


# ---------------------------------------------------------------- the deviceless compile


def check_compile_memory(toy: bool) -> Result:
    """The memory plan of a train step compiled for this GPU against the one XLA:GPU
    makes for a virtual GPU of the same kind (`jaxmoe.plan.targets`, what the planner and
    the GPU-compile tests read without a GPU): the train check's model, compiled here
    and, in a child process with JAX_PLATFORMS=cpu, deviceless. Figure: deviceless
    peak over this device's. Reported, not judged: without a device XLA neither
    autotunes nor knows cuDNN's workspaces, and how far that moves the plan is what
    this measures."""
    if on_cpu():
        return Result("compile_memory", "SKIPPED", note="no GPU to compare the deviceless "
                      "compile with")
    from jaxmoe.plan.planner import compile_train_step, peak_bytes

    kind = jax.devices()[0].device_kind
    names = target_names(kind)
    if not names:
        return Result("compile_memory", "SKIPPED", note=f"no spec for a {kind}")
    cfg = train_config(toy, 2)
    real = peak_bytes(compile_train_step(cfg)[0].memory_analysis())
    import tempfile

    import yaml
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "config.yaml", Path(tmp) / "plan.json"
        path.write_text(yaml.safe_dump(cfg.to_dict()))
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run([sys.executable, "-m", "jaxmoe.plan.planner", "--config", str(path),
                               "--target", names[0], "--json", str(out)], env=env,
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            return Result("compile_memory", "FAIL", note="deviceless plan: " + (
                proc.stderr.strip().splitlines() or ["?"])[-1][:200])
        deviceless = json.loads(out.read_text())["bytes_per_device"]["peak"]
    return Result("compile_memory", "PASS", f"{deviceless / real:.3f}", "reported",
                  f"peak {real / 1e9:.2f} GB compiled on this {kind}, "
                  f"{deviceless / 1e9:.2f} GB deviceless for {names[0]}")


def target_names(kind: str) -> list[str]:
    """The planner's targets (`jaxmoe.plan.targets`) of a device kind: the model's name as a
    word (a GH200 is no H200; an H100 PCIe gets the SXM spec)."""
    import re

    from jaxmoe.plan.targets import TARGETS
    return [n for n, t in TARGETS.items() if re.search(rf"\b{t.device_kind.split()[1]}\b", kind)]


def check_roofline(toy: bool) -> Result:
    """The expected step (`jaxmoe.plan.roofline` at `jaxmoe.plan.rates`, from the program
    compiled here) and the bound (datasheet peaks) beside the measured one, for the
    train check's model on this machine's GPUs: figure measured / expected, reported
    (the rates' table is refitted from such ratios: `jaxmoe.plan.rates`). Judged: the lowering
    the roofline relies on: with several GPUs every exchange of token rows is
    asynchronous; the same model with MXFP8 experts quantises each expert weight
    once per step (its working copy's quantisations run once, outside every loop)."""
    if on_cpu():
        return Result("roofline", "SKIPPED", note="no datasheet for a CPU")
    from jaxmoe.plan.counts import flops_per_token
    from jaxmoe.plan.hlo import Program
    from jaxmoe.plan.planner import compile_train_step
    from jaxmoe.plan.roofline import Link, quantisations, roofline, row_exchanges, summary
    from jaxmoe.step import build_steps
    from jaxmoe.plan.targets import TARGETS

    kind = jax.devices()[0].device_kind
    names = target_names(kind)
    if not names:
        return Result("roofline", "SKIPPED", note=f"no spec for a {kind}")
    cfg, timed = train_config(toy, 2), 10
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    batch = jax.device_put(np.random.default_rng(0).integers(
        0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), dtype=np.int32),
        steps.batch_sharding)
    state = steps.init(jax.random.PRNGKey(0))
    program = Program(steps.train_step.lower(state, batch).compile().as_text())
    for _ in range(2):  # compile and warm up
        state, metrics = steps.train_step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(timed):
        state, metrics = steps.train_step(state, batch)
    jax.block_until_ready(metrics)
    measured = (time.perf_counter() - start) / timed
    n, link = jax.device_count(), Link.of(TARGETS[names[0]])
    tokens = cfg.train.batch_size * cfg.train.seq_len
    walk = roofline(program, link)
    bound = walk.step_s
    predicted = summary(roofline(program, Link.of(TARGETS[names[0]], expected=True)),
                        flops_per_token(cfg) * tokens / n, tokens / n, link)
    problems = [f"synchronous exchange {name}" for name, asynchronous, _ in
                row_exchanges(program, walk) if not asynchronous]
    mx = override_config(cfg, ["moe.expert_precision=mxfp8"])
    weights = [q for q in quantisations(Program(compile_train_step(mx)[0].as_text()))
               if "working_copy" in q[2]]
    if not weights or any(runs != 1 or in_loop for runs, in_loop, *_ in weights):
        problems.append("MXFP8 weights not quantised once per step")
    if perturbed("roofline"):
        problems.append("perturbed")
    ratio, tflops = measured / predicted["step_s"], predicted["model_tflops_per_device"]
    return Result("roofline", "FAIL" if problems else "PASS", f"{ratio:.2f}",
                  "reported; lowering judged",
                  f"step measured {measured * 1e3:.1f} ms, expected "
                  f"{predicted['step_s'] * 1e3:.1f} ms at {names[0]}'s measured rates, bound "
                  f"{bound * 1e3:.1f} ms at its datasheet's "
                  f"({tflops:.0f} model TFLOP/s per GPU expected, {tflops / ratio:.0f} "
                  f"measured; {n} GPU(s))" + (": " + "; ".join(problems) if problems else ""))


# ---------------------------------------------------------------- the installed stack

# What the grouped expert GEMM's program depends on, pinned to one release each by the
# `cuda` extra (pyproject.toml): its JAX and plugin, and tokamax's kernel through jax-triton.
STACK = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "tokamax", "jax-triton",
         "triton", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl")


def extra_pins(extra: str) -> dict[str, str]:
    """Package -> version specifier of the stack in one of pyproject.toml's extras: its
    own requirements and those its `jax[cudaN]` brings (jaxlib and the CUDA plugin, from
    the installed jax's metadata)."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    pins = {}
    for r in map(Requirement, extras[extra]):
        pins[r.name] = str(r.specifier)
        for jax_extra in (r.extras if r.name == "jax" else ()):
            for dep in map(Requirement, importlib.metadata.requires("jax") or []):
                if dep.marker is not None and dep.marker.evaluate({"extra": jax_extra}):
                    pins[dep.name] = str(dep.specifier)
    return {k: v for k, v in pins.items() if k in STACK}


def one_release(spec: str) -> str | None:
    """The one release a specifier admits ("==X", or ">=X,<=X" as jax's metadata pins);
    None for a range."""
    from packaging.specifiers import SpecifierSet
    specs = list(SpecifierSet(spec))
    ops, versions = {s.operator for s in specs}, {s.version for s in specs}
    return versions.pop() if len(versions) == 1 and ops in ({"=="}, {">=", "<="}) else None


def not_installed_as(pins: dict[str, str]) -> list[str]:
    """The pins that this environment's installed releases do not meet."""
    import importlib.metadata

    from packaging.specifiers import SpecifierSet

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    return [f"{name} {version(name) or 'not installed'}, the extra pins {spec}"
            for name, spec in pins.items()
            if version(name) is None or version(name) not in SpecifierSet(spec)]


def check_stack(toy: bool) -> Result:
    """The JAX, CUDA plugin and grouped-GEMM kernels installed here are the releases the
    `cuda` extra pins (`cuda12` where JAX's CUDA 12 plugin is installed): the figures
    that follow are those of what `pip install -e ".[cuda]"` gives."""
    import importlib.util
    extra = "cuda12" if importlib.util.find_spec("jax_cuda12_plugin") else "cuda"
    pins = extra_pins(extra)
    if perturbed("stack"):
        pins["jax"] = "==0.0.1"
    missing = not_installed_as(pins)
    return Result("stack", "FAIL" if missing else "PASS", f"{len(pins) - len(missing)} of "
                  f"{len(pins)}", f"the {extra} extra's releases", "; ".join(missing))


# ---------------------------------------------------------------- main

CHECKS: dict[str, Callable[[bool], Result]] = {
    "stack": check_stack,
    "ragged_plan": check_ragged_plan,
    **{n: (lambda toy, n=n: check_dispatch(n, toy)) for n in DISPATCH_NAMES},
    "mxfp8": check_mxfp8,
    "mxfp8_native": check_mxfp8_native,
    "mxfp8_grouped": check_mxfp8_grouped,
    "train": check_train,
    "overlap": check_overlap,
    "compile_memory": check_compile_memory,
    "roofline": check_roofline,
}


def run_check(name: str, toy: bool) -> Result:
    """A check's result; an exception is a FAIL that names it."""
    try:
        return CHECKS[name](toy)
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return Result(name, "FAIL", note=f"{type(e).__name__}: {first}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=[*CHECKS, "env", "losses"])
    parser.add_argument("--table", help="append the result line to this file")
    parser.add_argument("--steps", type=int, default=5, help="losses: train steps")
    parser.add_argument("--toy", action="store_true",
                        help="toy shapes (implied by JAXMOE_GPU_SMOKE=1)")
    a = parser.parse_args(argv)
    toy = a.toy or os.environ.get("JAXMOE_GPU_SMOKE") == "1"
    if os.environ.get(FAIL_ENV) and os.environ[FAIL_ENV] not in CHECKS:  # a typo must not pass
        print(f"{FAIL_ENV}={os.environ[FAIL_ENV]!r} names no check (known: {', '.join(CHECKS)})",
              file=sys.stderr)
        return 2
    if a.check == "env":  # for gpu.sh: what this machine is, and the flags to compare
        cpu = on_cpu()
        print(f"backend={jax.default_backend()} devices={jax.device_count()}")
        for mode, flags in OVERLAP_FLAGS.items():
            print(f"overlap_{mode}='{'' if cpu else flags}'")
        return 0
    if a.check == "losses":  # for the overlap check: one line of JSON
        print(json.dumps(train_losses(overlap_config(toy, a.steps), runs=2)))
        return 0
    if a.check == "overlap":
        os.environ[PREALLOCATE] = "false"  # before the backend starts
    result = run_check(a.check, toy)
    print(result.line(), flush=True)
    if a.table:
        with open(a.table, "a") as f:
            f.write(result.line() + "\n")
    return 1 if result.status == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
