"""The layout a config should run on: `python -m jaxmoe.plan --search`.

For a config, a device count and a GPU, every layout jaxmoe can run is a
candidate: the mesh (data x stage x expert x context over the devices), the
pipeline's micro-batches, virtual stages and schedule where there are stages, what
each layer keeps for its backward (`train.remat`) and the expert dispatcher. A
candidate the config's own checks refuse is dropped, with the first reason
counted; one whose weights, gradients and optimizer state alone exceed the GPU's
memory (`static_bytes`, a lower bound from the parameter counts: no compile) is
pruned. The survivors are compiled for the GPU without one
(`jaxmoe.plan.planner`), cheapest static memory first, until the time budget is
spent, and ranked by their expected step (`jaxmoe.plan.rates`) among those whose
compiled peak fits. The winner is printed as the `--set` overrides that select it.

Every remat policy is a candidate, each compiled (every layout's `full` first, so
that a short budget still reaches every layout): keeping more for the backward
pass is not always faster (a pipeline's loop can spend more moving what a layer
keeps than recomputing it), and offloading costs what the host link allows.

`micro_batch` holds the sequences each GPU runs per pass (as a measured run it is
set beside had them): each candidate's accumulation slices are then what gives
that many, and one that cannot is refused. `only` narrows any choice to given
values (the mesh axes by size, the pipeline's, remat and dispatcher by name), so
that a search over hundreds of GPUs compiles the few layouts worth comparing.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass

from jaxmoe.config import MESH_AXES, Config, ConfigError, override_config
from jaxmoe.plan.counts import param_counts

# every `train.remat` policy (`jaxmoe.model.remat`; named here so that importing the
# search does not start JAX before the planner has chosen its platform)
REMATS = ("none", "full", "matmuls", "save_expert_gemms", "save_attention", "save_exchange",
          "offload")


@dataclass(frozen=True)
class Candidate:
    data: int
    stage: int
    expert: int
    context: int
    stage_microbatches: int
    virtual_stages: int
    remat: str
    dispatcher: str
    accumulation_steps: int = 1
    schedule: str = "circular"

    def overrides(self) -> list[str]:
        return [f"mesh.data={self.data}", f"mesh.stage={self.stage}",
                f"mesh.expert={self.expert}", f"mesh.context={self.context}",
                f"pipeline.stage_microbatches={self.stage_microbatches}",
                f"pipeline.virtual_stages={self.virtual_stages}", f"train.remat={self.remat}",
                f"moe.dispatcher={self.dispatcher}",
                f"train.accumulation_steps={self.accumulation_steps}",
                f"pipeline.schedule={self.schedule}"]

    def __str__(self) -> str:
        mesh = " x ".join(f"{a} {getattr(self, a)}" for a in MESH_AXES if getattr(self, a) > 1)
        pipe = (f", {self.stage_microbatches} micro-batches x {self.virtual_stages} virtual"
                + (", 1F1B" if self.schedule == "1f1b" else "") if self.stage > 1 else "")
        slices = f", {self.accumulation_steps} slices" if self.accumulation_steps > 1 else ""
        return f"{mesh or 'data 1'}{pipe}{slices}, remat {self.remat}, {self.dispatcher}"


# what `only` may narrow, and the Candidate field each names
CHOICES = ("data", "stage", "expert", "context", "stage_microbatches", "virtual_stages",
           "schedule", "remat", "dispatcher")


@dataclass
class Row:
    candidate: Candidate
    static_bytes: float
    peak_bytes: float | None = None
    expected_step_s: float | None = None
    bound_step_s: float | None = None
    tokens_per_s_per_device: float | None = None
    fits: bool | None = None
    xla_recomputed_s: float = 0.0  # of the expected step: XLA's rematerialisation to fit
    why_not: str = ""  # pruned, refused by the compiler, or past the budget
    compile_s: float = 0.0


def _factorisations(n: int, parts: int):
    """Every ordered way of writing n as a product of `parts` positive factors."""
    if parts == 1:
        yield (n,)
        return
    for f in range(1, n + 1):
        if n % f == 0:
            for rest in _factorisations(n // f, parts - 1):
                yield (f, *rest)


def candidates(cfg: Config, devices: int, axes: tuple[str, ...] = MESH_AXES,
               remats: tuple[str, ...] = REMATS,
               dispatchers: tuple[str, ...] | None = None,
               stage_microbatches: tuple[int, ...] = (1, 2, 4, 8),
               virtual_stages: tuple[int, ...] = (1, 2, 4),
               schedules: tuple[str, ...] = ("circular", "1f1b"),
               micro_batch: int | None = None,
               only: dict[str, tuple] | None = None,
               ) -> tuple[list[tuple[Candidate, Config]], Counter]:
    """Every layout of `cfg` on `devices` devices its checks accept (with its config),
    and how many were refused, by the first words of the reason. Mesh axes not in
    `axes` stay 1; `only` keeps the meshes whose axes take one of the sizes given, and
    replaces the lists of remat policies, dispatchers (where there is an expert axis)
    and pipeline micro-batches, virtual stages and schedules (where there are stages;
    1F1B only with `full`, as its checks say);
    `micro_batch`: sequences per GPU per pass, held by each candidate's accumulation
    slices (else the config's slices are kept)."""
    only = only or {}
    unknown = set(only) - set(CHOICES)
    if unknown:
        raise ValueError(f"only: {sorted(unknown)} are not layout choices {list(CHOICES)}")
    if dispatchers is None:
        dispatchers = ("alltoall", "ragged") if cfg.num_moe_layers else (cfg.moe.dispatcher,)
    remats = tuple(only.get("remat", remats))
    dispatchers = tuple(only.get("dispatcher", dispatchers))
    stage_microbatches = tuple(only.get("stage_microbatches", stage_microbatches))
    virtual_stages = tuple(only.get("virtual_stages", virtual_stages))
    schedules = tuple(only.get("schedule", schedules))
    out, refused = [], Counter()
    for sizes in _factorisations(devices, 4):
        data, stage, expert, context = sizes
        named = dict(zip(("data", "stage", "expert", "context"), sizes))
        if any(n > 1 and a not in axes for a, n in named.items()):
            continue
        if any(n not in only.get(a, (n,)) for a, n in named.items()):
            continue
        pipes = (itertools.product(stage_microbatches, virtual_stages, schedules) if stage > 1
                 else [(1, 1, "circular")])
        for (micro, virtual, schedule), remat, dispatcher in itertools.product(pipes, remats,
                                                                                dispatchers):
            if schedule == "1f1b" and remat != "full":
                continue  # 1F1B recomputes every chunk from its input: `full` is its one
            if expert == 1 and dispatcher != dispatchers[0]:
                continue  # without an expert axis the dispatchers are one program
            slices = cfg.train.accumulation_steps
            if micro_batch:
                per_slice = micro_batch * micro * data * expert  # the GPUs that split a pass
                slices = cfg.train.batch_size // per_slice
                if slices * per_slice != cfg.train.batch_size:
                    refused["train.accumulation_steps"] += 1
                    continue
            c = Candidate(data, stage, expert, context, micro, virtual, remat,
                          dispatcher if expert > 1 else cfg.moe.dispatcher, slices, schedule)
            try:
                out.append((c, override_config(cfg, c.overrides())))
            except ConfigError as e:
                refused[str(e).split(":")[0]] += 1
    return out, refused


def static_bytes(cfg: Config) -> float:
    """Per device, what the step must hold whatever its activations: a lower bound of
    its peak, so that pruning by it drops no layout that fits. Under ddp every
    device holds its working copy and gradient in the compute dtype; the fp32 master
    weights and Adam's two moments (the first in `optimizer.mu_dtype`) are split over
    the replicas under ZeRO-1, whole on each without it. Under fsdp all of it is
    split over `data`. Routed experts (the MTP modules' too) are split over the expert
    axis; everything is counted as if split over the stages, which only the MoE stack
    is (the embedding, head, dense layers and MTP modules are on every stage)."""
    counts, m, mesh = param_counts(cfg), cfg.model, cfg.mesh
    moe_layers = cfg.num_moe_layers + (m.mtp_layers if cfg.num_moe_layers else 0)
    experts = moe_layers * cfg.moe.num_experts * 3 * m.d_model * cfg.moe.expert_hidden
    dense = counts.total - experts
    mu = 2 if cfg.optimizer.mu_dtype == "bfloat16" else 4
    compute = 2 if m.compute_dtype == "bfloat16" else 4
    held = 2 * compute  # working copy and gradient
    split = 4 + mu + 4  # master weights, first and second moments
    if compute == 4 and (mesh.parallelism == "fsdp" or not mesh.zero1):
        split -= 4  # the fp32 weights are the working copy

    def per_param(replicas: int) -> float:
        if mesh.parallelism == "fsdp":
            return (held + split) / mesh.data
        return held + split / (replicas if mesh.zero1 else 1)

    return (dense / mesh.stage * per_param(mesh.data * mesh.expert * mesh.context)
            + experts / (mesh.stage * mesh.expert) * per_param(mesh.data * mesh.context))


def evaluate(cfg: Config, target: str) -> dict:
    """One candidate compiled for `target`: its peak, expected and bound step, and the
    seconds of the expected step that XLA's rematerialisation adds."""
    from jaxmoe.plan.hlo import Program
    from jaxmoe.plan.planner import compile_train_step, peak_bytes, routed_share
    from jaxmoe.plan.roofline import Link, hosts, roofline, xla_recomputation
    from jaxmoe.plan.targets import get_target
    from jaxmoe.step.pipelined import step_branches

    compiled, steps, _ = compile_train_step(cfg, target)
    program = Program(compiled.as_text(), step_branches(cfg, steps.mesh.shape["stage"]))
    program.routed_share = routed_share(cfg)
    host, gpu = hosts(steps.mesh), get_target(target)
    expected = roofline(program, Link.of(gpu, expected=True), host)
    return {"peak": peak_bytes(compiled.memory_analysis()), "expected": expected.step_s,
            "bound": roofline(program, Link.of(gpu), host).step_s,
            "xla_recomputed": xla_recomputation(expected)["seconds"]}


def search(cfg: Config, devices: int, target: str, budget_s: float = 600.0,
           progress=None, evaluate=evaluate, memory: float | None = None,
           **choices) -> tuple[list[Row], Counter]:
    """Every candidate's row, ranked: fitting ones by expected step, then the rest.
    `memory`: the bytes a device may hold (default: the target's)."""
    from jaxmoe.plan.targets import get_target

    from jax.errors import JaxRuntimeError

    memory = memory or get_target(target).memory
    found, refused = candidates(cfg, devices, **choices)
    # every layout's `full` first (the policy most likely to fit), then the others:
    # a budget too short for every policy still compiles every layout once
    rows = sorted((Row(c, static_bytes(config)) for c, config in found),
                  key=lambda r: (r.candidate.remat != "full", r.static_bytes))
    configs = dict(found)
    start = time.perf_counter()
    for i, row in enumerate(rows):
        if row.static_bytes > memory:
            row.why_not = f"pruned: weights and optimizer state {row.static_bytes / 1e9:.0f} GB"
            continue
        if time.perf_counter() - start > budget_s:
            row.why_not = "not compiled: past the time budget"
            continue
        if progress:
            progress(i, len(rows), row.candidate)
        began = time.perf_counter()
        try:
            figures = evaluate(configs[row.candidate], target)
        except (ConfigError, ValueError) as e:  # checks that need the mesh
            row.why_not = f"refused: {str(e).splitlines()[0][:100]}"
            continue
        except JaxRuntimeError as e:  # XLA failed on this one: rank the rest
            row.why_not = f"the compiler failed: {str(e).splitlines()[0][:100]}"
            continue
        row.compile_s = time.perf_counter() - began
        row.peak_bytes, row.fits = figures["peak"], figures["peak"] <= memory
        row.expected_step_s, row.bound_step_s = figures["expected"], figures["bound"]
        row.xla_recomputed_s = figures.get("xla_recomputed", 0.0)
        t = cfg.train
        row.tokens_per_s_per_device = t.batch_size * t.seq_len / devices / figures["expected"]
    rows.sort(key=lambda r: (not r.fits, r.expected_step_s is None,
                             r.expected_step_s or math.inf, r.static_bytes))
    return rows, refused


def print_search(rows: list[Row], refused: Counter, top: int = 12) -> None:
    if not rows:
        reasons = ", ".join(f"{n} by {why}" for why, n in refused.most_common(4))
        print("no layout takes these choices" + (f" ({reasons} refused)" if reasons else "")
              + ": check --axes, --only and --micro-batch against the devices and the batch")
        return
    gb = lambda b: "-" if b is None else f"{b / 1e9:,.1f} GB"  # noqa: E731
    compiled = [r for r in rows if r.expected_step_s is not None]
    reasons = ", ".join(f"{n} by {why}" for why, n in refused.most_common(4))
    print(f"{len(rows)} layouts the config accepts ({sum(refused.values())} refused"
          + (f": {reasons}" if reasons else "") + "); "
          f"{len(compiled)} compiled, {sum(1 for r in rows if r.why_not.startswith('pruned'))} "
          "pruned by their weights and optimizer state")
    print("| rank | layout | expected step | bound | tokens/s per GPU | peak | fits |")
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows[:top], 1):
        if r.expected_step_s is None:
            print(f"| - | {r.candidate} | {r.why_not} | | | {gb(r.static_bytes)} static | |")
            continue
        recomputed = (f", XLA recomputes {r.xla_recomputed_s:.2f} s to fit"
                      if r.xla_recomputed_s else "")
        print(f"| {i} | {r.candidate} | {r.expected_step_s:.3f} s | {r.bound_step_s:.3f} s "
              f"| {r.tokens_per_s_per_device:,.0f} | {gb(r.peak_bytes)} | "
              f"{'yes' if r.fits else 'no'}{recomputed} |")
    best = rows[0] if rows and rows[0].fits else None
    if best is None:
        print("no layout compiled fits: widen the budget, or add devices")
    else:
        print("best: " + " ".join(f"--set {o}" for o in best.candidate.overrides()))

