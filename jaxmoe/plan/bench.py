"""Micro-benchmarks: `python -m jaxmoe.plan.bench <subcommand> [--json PATH] ...`.

Each subcommand is a function registered in `SUBCOMMANDS` with its own
arguments; it returns a dict of numbers, which `--json` writes to a file.

  moe       forward+backward of the MoE block alone (router included, grouped
            dispatch, capacity factor 1.0) for several expert counts, against a
            dense SwiGLU MLP of the same active FLOPs.
  parallel  a whole train step under ddp + expert parallelism against fsdp, on
            8 devices: step time and bytes per collective kind, in one run.
  pipeline  a whole train step with 1, 2 and 4 pipeline stages on 8 devices,
            GPipe and circular (2 virtual stages), beside the predicted bubble.
  step      a whole train step of a small full model on one device: model-FLOPs
            utilisation against the dense-matmul rate measured in the same run.
  experts   tokens/s of that model's train step at 8 and at 128 experts (top-4,
            same expert size): what many experts cost; beside each, the
            optimizer update alone, which bounds the ratio at few tokens per step.
  muon      a config's train step on one device with Muon against AdamW, and each
            optimizer's update alone: Muon's Newton-Schulz share of the step.

Cases are timed round-robin, so machine noise hits every case alike, and the
median of the repeats is reported.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import MoEConfig
from jaxmoe.model.layers import swiglu
from jaxmoe.model.moe import MoE
from jaxmoe.runtime.fake_devices import FLAG


class Subcommand(NamedTuple):
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict]
    help: str


SUBCOMMANDS: dict[str, Subcommand] = {}


def subcommand(name: str, add_args: Callable[[argparse.ArgumentParser], None], help: str):
    def wrap(fn: Callable[[argparse.Namespace], dict]):
        SUBCOMMANDS[name] = Subcommand(add_args, fn, help)
        return fn
    return wrap


# ---------------------------------------------------------------- timing


def keep_freed_memory() -> bool:
    """Stops glibc from returning freed buffers to the OS (no mmap, no trim).

    XLA:CPU allocates its outputs and temporaries afresh on every call; above
    glibc's mmap threshold each one is mapped and unmapped, and a freed heap top
    above the trim threshold is handed back, so every step page-faults its big
    buffers in again (~0.7 s of a 1.7 s MoE step at E=128, whose weight gradients
    alone are 768 MB). mallopt takes an int but glibc keeps the trim threshold as
    a size_t: -1 means never trim, where 2**31 - 1 still let a step's >2 GB of
    temporaries go back (and fault in again) every step. Returns False where
    mallopt is missing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
    return all(libc.mallopt(opt, val) == 1 for opt, val in
               ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1), (M_ARENA_MAX, 1)))


def time_round_robin(cases: dict[str, Callable[[], object]], repeats: int,
                     warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each case; one call of every case per round."""
    for fn in cases.values():  # compile, then warm up
        for _ in range(1 + warmup):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def fwd_bwd(apply: Callable[[object, jax.Array], jax.Array], params, x: jax.Array,
            ct: jax.Array) -> Callable[[], object]:
    """A jitted value_and_grad of <apply(params, x), ct> w.r.t. params and x, as a thunk."""

    def loss(p, x):
        return jnp.sum(apply(p, x) * ct)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return lambda: step(params, x)


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


# ---------------------------------------------------------------- moe


def _moe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--expert-hidden", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--dispatcher", default="grouped")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)


def _moe_case(num_experts: int, a: argparse.Namespace, x_TxD: jax.Array, ct_TxD: jax.Array):
    """(fwd+bwd thunk, dropped fraction on these inputs) of one MoE block."""
    cfg = MoEConfig(num_experts=num_experts, top_k=a.top_k, expert_hidden=a.expert_hidden,
                    score_func="softmax", dispatcher=a.dispatcher,
                    capacity_factor=a.capacity_factor)
    model = MoE(a.d_model, cfg, std=0.02, out_std=0.02, rngs=nnx.Rngs(a.seed + num_experts))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def apply(p, x_TxD, with_aux=False):
        y_1xTxD, aux = nnx.merge(graphdef, p, rest)(x_TxD[None])
        return (y_1xTxD[0], aux) if with_aux else y_1xTxD[0]

    dropped = jax.jit(lambda p, x: apply(p, x, with_aux=True)[1]["dropped"])(params, x_TxD)
    return fwd_bwd(apply, params, x_TxD, ct_TxD), int(dropped) / (x_TxD.shape[0] * a.top_k)


@subcommand("moe", _moe_args, "MoE block vs a dense SwiGLU of the same active FLOPs")
def bench_moe(a: argparse.Namespace) -> dict:
    T, D, F, K = a.tokens, a.d_model, a.expert_hidden, a.top_k
    kx, kc, kg, kd = jax.random.split(jax.random.key(a.seed), 4)
    x_TxD = jax.random.normal(kx, (T, D), jnp.float32)
    ct_TxD = jax.random.normal(kc, (T, D), jnp.float32)
    dense = (0.02 * jax.random.normal(kg, (D, 2 * K * F), jnp.float32),
             0.02 * jax.random.normal(kd, (K * F, D), jnp.float32))
    cases = {"dense": fwd_bwd(lambda p, x: swiglu(x, *p), dense, x_TxD, ct_TxD)}
    drop = {}
    for E in a.experts:
        cases[f"moe_E{E}"], drop[f"moe_E{E}"] = _moe_case(E, a, x_TxD, ct_TxD)
    secs = time_round_robin(cases, a.repeats)
    flops = 6 * 3 * D * K * F * T  # fwd+bwd matmuls of the active expert weights
    result = {"shape": {"tokens": T, "d_model": D, "expert_hidden": F, "top_k": K,
                        "capacity_factor": a.capacity_factor, "dispatcher": a.dispatcher,
                        "dtype": "float32", "repeats": a.repeats},
              "cases": {name: {"seconds": s, "tokens_per_s": T / s, "gflops": flops / s / 1e9,
                               "drop_fraction": drop.get(name, 0.0)}
                        for name, s in secs.items()}}
    tps = {name: c["tokens_per_s"] for name, c in result["cases"].items()}
    E0 = a.experts[0]
    ratios = {f"moe_E{E0}/dense": tps[f"moe_E{E0}"] / tps["dense"]}
    ratios.update({f"E{E}/E{E0}": tps[f"moe_E{E}"] / tps[f"moe_E{E0}"] for E in a.experts[1:]})
    result["ratios"] = ratios
    rows = [("case", "ms", "tokens/s", "GFLOP/s", "dropped")]
    rows += [(n, f"{c['seconds'] * 1e3:.1f}", f"{c['tokens_per_s']:.0f}", f"{c['gflops']:.1f}",
              f"{c['drop_fraction']:.2%}") for n, c in result["cases"].items()]
    rows += [("ratio " + n, "", f"{r:.3f}", "", "") for n, r in ratios.items()]
    print_table(rows)
    return result


# ---------------------------------------------------------------- parallel

PARALLEL_CASES = {  # (name, overrides): the mission's design against the FSDP it replaces
    "ddp+alltoall 2x4": ["mesh.data=2", "mesh.expert=4", "mesh.parallelism=ddp",
                         "moe.dispatcher=alltoall"],
    # the other GPU transport: only the routed rows travel, by ragged_all_to_all
    "ddp+ragged 2x4": ["mesh.data=2", "mesh.expert=4", "mesh.parallelism=ddp",
                       "moe.dispatcher=ragged"],
    "fsdp+alltoall 2x4": ["mesh.data=2", "mesh.expert=4", "mesh.parallelism=fsdp",
                          "moe.dispatcher=alltoall"],
    "fsdp 8x1": ["mesh.data=8", "mesh.expert=1", "mesh.parallelism=fsdp",
                 "moe.dispatcher=grouped"],
}


def _set_arg(p: argparse.ArgumentParser, after: str) -> None:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"config overrides, applied after {after}")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/cpu8_ep.yaml")
    p.add_argument("--repeats", type=int, default=5)
    _set_arg(p, "the config (a case's mesh and dispatcher win over them)")


class StepCase(NamedTuple):
    run: Callable[[], object]  # one train step on fixed random tokens
    cfg: object
    compile: Callable[[], object]  # the step's compiled program


def _train_step_case(config: str, overrides: list[str], num_devices: int = 8) -> StepCase:
    """One train step of `config` on the first `num_devices` devices, as a thunk."""
    from jaxmoe.config import load_config
    from jaxmoe.parallel.sharding import make_mesh
    from jaxmoe.step import build_steps

    if jax.device_count() < num_devices:
        raise SystemExit(f"this benchmark needs {num_devices} devices; on CPU run it with "
                         f"XLA_FLAGS={FLAG}={num_devices}")
    cfg = load_config(config, overrides)
    steps = build_steps(cfg, make_mesh(cfg.mesh, jax.devices()[:num_devices]))
    state = [steps.init(jax.random.PRNGKey(0))]
    tokens = jax.random.randint(jax.random.PRNGKey(1),
                                (cfg.train.batch_size, cfg.train.seq_len + 1), 0,
                                cfg.model.vocab_size)
    batch = jax.device_put(tokens, steps.batch_sharding)

    def run():
        state[0], metrics = steps.train_step(state[0], batch)
        return metrics

    return StepCase(run, cfg, lambda: steps.train_step.lower(state[0], batch).compile())


@subcommand("parallel", _parallel_args,
            "ddp+EP vs fsdp: train-step time, collective bytes sent per device and gradient "
            "reductions per step on 8 devices")
def bench_parallel(a: argparse.Namespace) -> dict:
    from jaxmoe.plan.collectives import compiled_collectives, totals

    runs, traffic = {}, {}
    for name, overrides in PARALLEL_CASES.items():
        case = _train_step_case(a.config, a.set + overrides)
        runs[name], traffic[name] = case.run, totals(compiled_collectives(case.compile()))
    secs = time_round_robin(runs, a.repeats)
    first = next(iter(secs))
    reductions = ("all-reduce", "reduce-scatter")
    result = {"config": a.config, "overrides": a.set, "cases": {
        name: {"step_s": secs[name], "vs_" + first: secs[name] / secs[first],
               "collective_bytes": {k: t.bytes for k, t in traffic[name].items()},
               "collective_total": sum(t.bytes for t in traffic[name].values()),
               # all-reduce and reduce-scatter runs per step, and those inside loops
               "reductions_per_step": sum(traffic[name][k].runs for k in reductions),
               "reductions_in_loops": sum(traffic[name][k].ops_in_loops for k in reductions)}
        for name in runs}}
    kinds = list(next(iter(traffic.values())))
    rows = [("case", "step s", "/first", "total MB") + tuple(k + " MB" for k in kinds)
            + ("reductions", "in loops")]
    rows += [(n, f"{c['step_s']:.3f}", f"{c['vs_' + first]:.2f}", f"{c['collective_total'] / 1e6:.2f}")
             + tuple(f"{c['collective_bytes'][k] / 1e6:.2f}" for k in kinds)
             + (str(c["reductions_per_step"]), str(c["reductions_in_loops"]))
             for n, c in result["cases"].items()]
    print_table(rows)
    return result


# ---------------------------------------------------------------- pipeline


PIPELINE_LAYOUTS = {"S=1": (1, 1), "S=2": (2, 1), "S=4": (4, 1), "S=2 V=2": (2, 2),
                    "S=4 V=2": (4, 2)}  # name: (stages S, virtual stages W)


def _pipeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/cpu8_ep.yaml")
    p.add_argument("--stage-microbatches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layouts", nargs="+", choices=list(PIPELINE_LAYOUTS),
                   default=list(PIPELINE_LAYOUTS), help="which layouts to time (S=1 always runs)")
    _set_arg(p, "the config (a layout's mesh and pipeline keys win over them)")


@subcommand("pipeline", _pipeline_args,
            "train-step time with 1, 2 and 4 pipeline stages (GPipe and circular) on 8 devices")
def bench_pipeline(a: argparse.Namespace) -> dict:
    from jaxmoe.parallel.pipeline import bubble_fraction

    M = a.stage_microbatches
    layout = {name: PIPELINE_LAYOUTS[name] for name in PIPELINE_LAYOUTS
              if name == "S=1" or name in a.layouts}
    common = ["mesh.expert=1", "moe.dispatcher=grouped", "model.num_layers=9",
              "model.num_dense_layers=1"]
    cases = {name: common + a.set + [f"mesh.stage={S}", f"mesh.data={8 // S}",
                                     f"pipeline.stage_microbatches={M if S > 1 else 1}",
                                     f"pipeline.virtual_stages={W}"]
             for name, (S, W) in layout.items()}
    runs = {name: _train_step_case(a.config, overrides).run for name, overrides in cases.items()}
    secs = time_round_robin(runs, a.repeats)
    result = {"config": a.config, "overrides": a.set, "stage_microbatches": M, "cases": {
        name: {"step_s": secs[name], "vs_S1": secs[name] / secs["S=1"],
               "bubble_predicted": bubble_fraction(S, M if S > 1 else 1, W)}
        for name, (S, W) in layout.items()}}
    rows = [("stages", "step s", "/S=1", "bubble (S-1)/(VM+S-1)")]
    rows += [(n, f"{c['step_s']:.3f}", f"{c['vs_S1']:.2f}", f"{c['bubble_predicted']:.3f}")
             for n, c in result["cases"].items()]
    print_table(rows)
    return result


# ---------------------------------------------------------------- step, experts

# A small full model for one CPU: big enough that its GEMMs run near the
# machine's matmul rate, small enough to step in seconds.
SMALL_MODEL = ["model.d_model=512", "model.num_heads=8", "model.num_kv_heads=4",
               "model.num_layers=4", "model.num_dense_layers=1", "model.mlp_hidden=2048",
               "moe.top_k=4", "moe.expert_hidden=512", "moe.shared_expert_hidden=0",
               "moe.capacity_factor=1.0", "moe.dispatcher=grouped",
               "train.batch_size=32", "train.seq_len=256"]


def _matmul_case(n: int, dtype, chain: int = 16) -> tuple[Callable[[], object], float]:
    """(thunk of `chain` dependent [n, n] x [n, n] matmuls in one program, their FLOPs).

    A chain long enough to time like a train step, so both see the same machine.
    """
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype) / n ** 0.5  # keeps the chain's scale

    @jax.jit
    def matmuls(a, b):
        return jax.lax.fori_loop(0, chain, lambda _, c: c @ b, a)

    return lambda: matmuls(a, b), 2.0 * n ** 3 * chain


def _small_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="overrides applied after the small-model ones")
    p.add_argument("--repeats", type=int, default=5)


def _step_args(p: argparse.ArgumentParser) -> None:
    _small_model_args(p)
    p.add_argument("--matmul-size", type=int, default=1024,
                   help="n of the n x n x n matmul whose rate is the reference")


@subcommand("step", _step_args,
            "model-FLOPs utilisation of a train step vs the measured dense-matmul rate")
def bench_step(a: argparse.Namespace) -> dict:
    from jaxmoe.plan.counts import flops_per_token

    run, cfg, _ = _train_step_case(a.config, SMALL_MODEL + a.set, num_devices=1)
    matmul, matmul_flops = _matmul_case(a.matmul_size, jnp.dtype(cfg.model.compute_dtype))
    secs = time_round_robin({"train_step": run, "matmul": matmul}, a.repeats)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    step_flops = flops_per_token(cfg) * tokens
    matmul_rate, step_rate = matmul_flops / secs["matmul"], step_flops / secs["train_step"]
    result = {"config": a.config, "overrides": SMALL_MODEL + a.set,
              "matmul": {"n": a.matmul_size, "seconds": secs["matmul"], "flops_per_s": matmul_rate},
              "train_step": {"seconds": secs["train_step"], "model_flops": step_flops,
                             "model_flops_per_s": step_rate, "tokens_per_s": tokens / secs["train_step"]},
              "mfu_vs_matmul": step_rate / matmul_rate}
    print_table([("case", "s", "GFLOP/s", "tokens/s"),
                 (f"matmul {a.matmul_size}^3", f"{secs['matmul']:.4f}", f"{matmul_rate / 1e9:.1f}", ""),
                 ("train step (model FLOPs)", f"{secs['train_step']:.3f}", f"{step_rate / 1e9:.1f}",
                  f"{tokens / secs['train_step']:.0f}"),
                 ("ratio MFU / matmul rate", "", f"{result['mfu_vs_matmul']:.3f}", "")])
    return result


def _experts_args(p: argparse.ArgumentParser) -> None:
    _small_model_args(p)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 128])
    p.add_argument("--no-update-case", dest="update_case", action="store_false",
                   help="leave out the optimizer-update-alone cases (they hold one more "
                        "copy of each model's parameters, moments and gradients)")


def _update_case(cfg) -> Callable[[], object]:
    """The train step's parameter update alone (gradient norm, fused AdamW with its
    skip) on constant gradients of `cfg`'s parameter shapes, as a thunk."""
    from jaxmoe.optim import make_optimizer
    from jaxmoe.step import abstract_model, apply_gradients

    _, abs_params, _ = abstract_model(cfg)
    tx = make_optimizer(cfg.optimizer, cfg.train.steps)
    params = jax.tree.map(lambda a: jnp.full(a.shape, 0.01, a.dtype), abs_params)
    grads = jax.tree.map(lambda a: jnp.full(a.shape, 1e-3, a.dtype), abs_params)
    state = [params, tx.init(params)]
    update = jax.jit(lambda p, o, g: apply_gradients(tx, p, o, g, jnp.float32(0))[:2],
                     donate_argnums=(0, 1))

    def run():
        state[0], state[1] = update(state[0], state[1], grads)
        return state[0]

    return run


@subcommand("experts", _experts_args,
            "train-step tokens/s of the small full model at 8 vs 128 experts (top-4)")
def bench_experts(a: argparse.Namespace) -> dict:
    from jaxmoe.plan.counts import param_counts

    runs, cfgs = {}, {}
    for E in a.experts:
        runs[f"E{E}"], cfgs[f"E{E}"], _ = _train_step_case(
            a.config, SMALL_MODEL + a.set + [f"moe.num_experts={E}"], num_devices=1)
        if a.update_case:
            runs[f"E{E} update"] = _update_case(cfgs[f"E{E}"])
    secs = time_round_robin(runs, a.repeats)
    first = f"E{a.experts[0]}"
    result = {"config": a.config, "overrides": SMALL_MODEL + a.set, "cases": {}}
    for name, cfg in cfgs.items():
        tokens, counts = cfg.train.batch_size * cfg.train.seq_len, param_counts(cfg)
        result["cases"][name] = {"step_s": secs[name], "tokens_per_s": tokens / secs[name],
                                 "params_total": counts.total, "params_active": counts.active,
                                 "update_s": secs.get(f"{name} update")}
    cases = result["cases"]
    result["ratios"] = {f"{n}/{first}": c["tokens_per_s"] / cases[first]["tokens_per_s"]
                        for n, c in cases.items() if n != first}
    if a.update_case:
        # What the ratio would be if the larger model cost nothing more than its
        # larger optimizer update: the update's share of the gap.
        result["ratio_if_only_update_differed"] = {
            f"{n}/{first}": cases[first]["step_s"] / (cases[first]["step_s"] + c["update_s"]
                                                      - cases[first]["update_s"])
            for n, c in cases.items() if n != first}
    rows = [("case", "params", "active", "step s", "update s", "tokens/s")]
    rows += [(n, f"{c['params_total'] / 1e6:.0f}M", f"{c['params_active'] / 1e6:.0f}M",
              f"{c['step_s']:.3f}", "" if c["update_s"] is None else f"{c['update_s']:.3f}",
              f"{c['tokens_per_s']:.0f}") for n, c in cases.items()]
    rows += [("ratio " + n, "", "", "", "", f"{r:.3f}") for n, r in result["ratios"].items()]
    rows += [("  if only the update differed", "", "", "", "", f"{r:.3f}")
             for r in result.get("ratio_if_only_update_differed", {}).values()]
    print_table(rows)
    return result


def _muon_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--repeats", type=int, default=7)
    _set_arg(p, "the config")


@subcommand("muon", _muon_args,
            "train step and optimizer update alone with Muon against AdamW, one device")
def bench_muon(a: argparse.Namespace) -> dict:
    runs, cfgs = {}, {}
    for name in ("adamw", "muon"):
        case = _train_step_case(a.config, a.set + [f"optimizer.name={name}"], num_devices=1)
        runs[name], cfgs[name] = case.run, case.cfg
        runs[f"{name} update"] = _update_case(case.cfg)
    secs = time_round_robin(runs, a.repeats)
    extra = secs["muon update"] - secs["adamw update"]
    result = {"config": a.config, "overrides": a.set, "seconds": secs,
              "step_ratio_muon_over_adamw": secs["muon"] / secs["adamw"],
              # what Muon's update adds over AdamW's, as a share of Muon's step
              "muon_update_extra_share": extra / secs["muon"]}
    rows = [("case", "s")] + [(n, f"{s:.4f}") for n, s in secs.items()]
    rows += [("step muon / adamw", f"{result['step_ratio_muon_over_adamw']:.3f}"),
             ("update extra / muon step", f"{result['muon_update_extra_share']:.3f}")]
    print_table(rows)
    return result


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The arguments of `python -m jaxmoe.plan.bench`; docs/reference/commands.md is generated from
    them."""
    parser = argparse.ArgumentParser(prog="python -m jaxmoe.plan.bench", description=__doc__.split("\n")[0])
    subs = parser.add_subparsers(dest="command", required=True)
    for name, sc in SUBCOMMANDS.items():
        p = subs.add_parser(name, help=sc.help)
        p.add_argument("--json", default=None, help="write the numbers to this file")
        p.add_argument("--malloc", choices=["keep", "default"], default="keep",
                       help="keep: freed memory stays mapped (see keep_freed_memory)")
        sc.add_args(p)
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    kept = args.malloc == "keep" and keep_freed_memory()
    result = SUBCOMMANDS[args.command].run(args)
    result["malloc"] = "keep" if kept else "default"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
