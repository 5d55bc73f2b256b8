"""python -m jaxmoe.plan --config X [--mesh data=1,expert=8] [--target b300] [--json FILE]
python -m jaxmoe.plan --config X --target b300 --search [--devices N] [--budget-s S]

Proves (or refutes) that a configuration fits, without allocating the model: lowers
and compiles the real train step against abstract inputs, one device per device
of the mesh, and reads from the compiled program, per device: parameter,
optimizer-state, gradient and activation memory and the peak; the bytes each kind
of collective moves per step, within hosts and between them; the FLOPs of its
matrix products per named scope and pass, and what the expert GEMMs do against
the routed rows' work. On a GPU target it walks the compiled program's schedule
twice: at the rates GPUs of that generation measurably reach (`jaxmoe.plan.rates`),
the expected step, and at the datasheet's peaks, the bound; model TFLOP/s in PaLM's,
Megatron's and MaxText's counts (`--reference-tflops` and `--reference-count`
print a measured figure beside them in its own count), with its assumptions.
`--search` ranks the layouts a config could run on by their expected step
(`jaxmoe.plan.search`).

--target h100|h200|b200|b300 compiles for that GPU with XLA:GPU's own compiler,
which runs without a GPU (`jaxmoe.plan.targets`; the `gpu-compile` extra): the program
a GPU host would run, with nothing stood in. --target cpu (the default) compiles
for fake CPU devices instead, with stand-ins for what XLA:CPU compiles far bigger
than a GPU runs it (it says which), and judges the fit against --device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

from jaxmoe.config import MESH_AXES as AXES
from jaxmoe.plan.counts import FLOP_COUNTS
from jaxmoe.plan.targets import EXTRA, TARGETS, gpu_compiler_available
from jaxmoe.runtime.fake_devices import cpu_devices_env

# expert GEMM work relative to forward: the backward pass does two GEMMs per forward one
_PASS_WEIGHT = {"forward": 1, "backward": 2, "recompute": 1}


def _parse_mesh(text: str | None) -> list[str]:
    if not text:
        return []
    out = []
    for part in text.split(","):
        axis, _, value = part.partition("=")
        if axis.strip() not in AXES or not value.strip().lstrip("-").isdigit():
            raise SystemExit(f"error: --mesh takes data=N,stage=N,context=N,expert=N; "
                             f"got {part!r}")
        out.append(f"mesh.{axis.strip()}={int(value)}")
    return out


def _cpu_stand_ins(cfg) -> tuple[list[str], list[str]]:
    """Overrides for a CPU compile of a GPU config, and what each stands in for."""
    overrides, notes = [], []
    if cfg.num_moe_layers and cfg.moe.dispatcher == "ragged":
        overrides.append("moe.dispatcher=alltoall")
        notes.append("compiled with alltoall in place of ragged at the same capacity factor (on "
                     "CPU ragged runs through a padded stand-in exchange that moves R x the "
                     "rows; alltoall's buffers hold as many rows as ragged's)")
    if not cfg.model.attention_block and cfg.train.seq_len % 512 == 0:
        overrides.append("model.attention_block=512")
        notes.append("attention compiled blockwise (512 x 512 score blocks) in place of the GPU's "
                     "fused kernel: neither holds the L x L scores, as XLA:CPU's would")
    return overrides, notes


def routed_expert_flops(cfg) -> float:
    """Forward FLOPs per device per step of the expert GEMMs on exactly the routed
    copies: 6 D F per copy (gate/up 2 D 2F, down 2 F D), the device's share of the
    batch's copies, through the MoE layers its stage holds."""
    if not cfg.num_moe_layers:
        return 0.0
    m, moe, t = cfg.model, cfg.moe, cfg.train
    copies = t.batch_size * t.seq_len // cfg.mesh.token_shards * moe.top_k
    layers = cfg.num_moe_layers / max(cfg.mesh.stage, 1)
    return 6.0 * m.d_model * moe.expert_hidden * copies * layers


def cache_bytes_per_token(cfg) -> int:
    """Bytes a KV cache in the compute dtype keeps per token over every layer."""
    import jax.numpy as jnp

    from jaxmoe.model.kv_cache import cache_numbers_per_token
    return (cache_numbers_per_token(cfg.model) * cfg.model.num_layers
            * jnp.dtype(cfg.model.compute_dtype).itemsize)


def routed_share(cfg) -> float:
    """The share of the expert buffers' rows that the routed copies fill at balanced
    routing: 1 / `moe.capacity_factor` (less where a buffer's rows round up), what a
    grouped GEMM over the packed rows computes (`Program.routed_share`)."""
    return 1.0 / cfg.moe.capacity_factor if cfg.num_moe_layers else 1.0


def expert_gemm_ratios(expert_flops: dict[str, float], routed_forward: float) -> dict[str, float]:
    """Per pass: the program's expert-GEMM FLOPs over the routed rows' (backward: twice
    the forward's); "max" is the worst pass."""
    if not routed_forward:
        return {}
    ratios = {p: f / (routed_forward * _PASS_WEIGHT[p]) for p, f in expert_flops.items() if f}
    return ratios | {"max": max(ratios.values(), default=0.0)}


def compile_train_step(cfg, target: str | None = None, hosts: int | None = None,
                       dump_to: str | None = None):
    """`cfg`'s train step compiled against abstract inputs, for `target` (None: the
    devices this process has; a GPU's name: as many virtual ones as the mesh has, on
    `hosts` hosts, `targets.topology`): (compiled, steps, abstract state). Nothing is
    allocated. `dump_to`: a directory for XLA's dump of the program (its buffer
    assignment and memory report: `largest_buffers`)."""
    import contextlib

    import jax
    import jax.numpy as jnp

    from jaxmoe import checkpoint
    from jaxmoe.parallel.sharding import make_mesh
    from jaxmoe.step import build_steps
    from jaxmoe.plan.targets import compile_deviceless, traced_on, virtual_devices

    devices = None
    if target is not None:
        devices = virtual_devices(target, cfg.mesh.devices, hosts)
    steps = build_steps(cfg, make_mesh(cfg.mesh, devices))
    abstract = checkpoint.abstract_target(steps)
    t = cfg.train
    batch = jax.ShapeDtypeStruct((t.batch_size, t.seq_len + 1), jnp.int32,
                                 sharding=steps.batch_sharding)
    # kernel libraries that read JAX's default device (tokamax), and JAX's own checks of
    # what cuDNN takes, see the target's
    with contextlib.ExitStack() as on_target:
        if devices:
            on_target.enter_context(jax.default_device(devices[0]))
            on_target.enter_context(traced_on(devices[0]))
        lowered = steps.train_step.trace(abstract, batch).lower()
    dump = None if dump_to is None else {
        "xla_dump_to": dump_to, "xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": "^$",
        "xla_dump_hlo_module_re": ".*train_step.*"}
    compiled = lowered.compile(dump) if target is None else compile_deviceless(lowered, dump)
    return compiled, steps, abstract


def largest_buffers(dump_dir: str, top: int = 6) -> list[dict]:
    """The largest temporary allocations of the program's device memory (not its
    arguments), from XLA's memory report in `dump_dir` (`compile_train_step(dump_to=
    ...)`): bytes, and the values that share each (over the step several values may
    reuse one buffer)."""
    from pathlib import Path
    reports = sorted(Path(dump_dir).glob("*train_step*memory-usage-report.txt"))
    if not reports:
        return []
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    out = []
    for line in reports[-1].read_text().split("\n\n", 1)[0].splitlines():
        fields = [f.strip() for f in line.split(";")]
        if len(fields) != 5 or not fields[1][:1].isdigit():
            continue
        number, unit = fields[1][:-3], fields[1][-3:]
        if unit.endswith("B") and not unit[:-1].isalpha():
            number, unit = fields[1][:-1], "B"
        out.append({"bytes": int(float(number) * units[unit]), "values": fields[4]})
    return out[:top]


def peak_bytes(memory) -> int:
    """A compiled program's peak device memory from its `memory_analysis()`: arguments
    and outputs (donated ones once) and temporaries."""
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes
            - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


def scale_out_bytes(ops, mesh) -> dict[str, int]:
    """Per kind, the bytes sent per device over the network between hosts: an
    all-to-all's share for peers on other hosts; all of any other collective whose
    groups span hosts (an upper bound: a ring over two hosts sends only part of its
    traffic between them)."""
    host = [d.process_index for d in mesh.devices.flat]  # the program's device order
    out = {}
    for c in ops:
        if not c.sent_bytes or all(len({host[i] for i in g}) == 1 for g in c.groups):
            continue
        share = 1.0
        if c.kind == "all-to-all":  # an equal part to each peer; those on its host stay on NVLink
            g = c.groups[0]
            share = sum(host[i] != host[g[0]] for i in g) / (len(g) - 1)
        out[c.kind] = out.get(c.kind, 0) + int(round(c.sent_bytes * c.runs * share))
    return out


def throughput_bound(model_flops: float, flops, moved: dict, across: dict,
                     datasheet) -> dict:
    """The most model FLOP/s per GPU this program allows on `datasheet`'s peaks and
    links: its matrix products at peak (the block-scaled MXFP8 ones, `flops` a
    `ProgramFlops`, at the fp8 peak), its collectives at link bandwidth, NVLink and the
    network in parallel. A bound from the compiled program, not a measurement."""
    flops_by_scope, fp8 = flops.by_scope, flops.block_scaled
    total = sum(sum(v.values()) for v in flops_by_scope.values())
    compute_s = (total - fp8) / datasheet.peak("bf16") + (fp8 / datasheet.peak("fp8") if fp8 else 0)
    out_bytes = sum(across.values())
    scale_up_s = (sum(moved.values()) - out_bytes) / datasheet.scale_up
    scale_out_s = out_bytes / datasheet.scale_out
    overlapped = max(compute_s, scale_up_s, scale_out_s)
    serial = compute_s + scale_up_s + scale_out_s
    return {"compute_s_at_peak": compute_s, "fp8_flops": fp8, "bf16_flops": total - fp8,
            "fp8_peak": datasheet.peak("fp8"), "bf16_peak": datasheet.peak("bf16"),
            "scale_up_s": scale_up_s, "scale_out_s": scale_out_s,
            "model_tflops_bound": model_flops / overlapped / 1e12,
            "model_tflops_no_overlap": model_flops / serial / 1e12}


def plan(config_path: str, overrides: list[str], target: str, device: str, mfu: float) -> dict:
    """The plan `python -m jaxmoe.plan` prints (and `--json` writes): the config's train
    step compiled for `target` (a GPU from `jaxmoe.plan.targets`, or "cpu") on its
    mesh, judged against `device`'s datasheet; `mfu` is the utilisation the simple
    compute estimate assumes. Nothing is allocated."""
    import jax

    from jaxmoe.config import load_config
    from jaxmoe.plan.counts import flops_per_token, param_counts
    from jaxmoe.plan.hlo import Program
    from jaxmoe.plan.collectives import collectives, totals
    from jaxmoe.parallel.pipeline import bubble_fraction
    from jaxmoe.step.pipelined import step_branches
    from jaxmoe.plan.program_flops import program_flops
    from jaxmoe.plan.roofline import (Link, hosts, quantisation_cost, roofline, summary,
                                      xla_recomputation)
    from jaxmoe.step import uses_per_device_step

    cfg = load_config(config_path, overrides)
    notes = []
    if target == "cpu":
        stand_ins, notes = _cpu_stand_ins(cfg)
        cfg = load_config(config_path, overrides + stand_ins)
    devices = cfg.mesh.devices
    print(f"compiling the train step for {devices} "
          + ("fake CPU devices" if target == "cpu" else f"virtual {target.upper()}s (XLA:GPU)")
          + " ...", flush=True)
    with tempfile.TemporaryDirectory() as dump:
        compiled, steps, abstract = compile_train_step(cfg, None if target == "cpu" else target,
                                                       dump_to=dump)
        buffers = largest_buffers(dump)
    mesh = steps.mesh
    mem = compiled.memory_analysis()
    # a 1F1B pass's stages, each its own branches: in the walk and the counts
    program = Program(compiled.as_text(), step_branches(cfg, mesh.shape["stage"]))
    program.routed_share = routed_share(cfg)

    def per_device(tree) -> int:
        return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                   for a in jax.tree.leaves(tree))

    n = mesh.size
    params = per_device(abstract.params)
    opt = per_device(abstract.opt_state)
    grads = params  # fp32, laid out like the master weights they update
    peak = peak_bytes(mem)
    ops = collectives(program)
    traffic = totals(ops)
    moved = {k: t.bytes for k, t in traffic.items()}
    across = scale_out_bytes(ops, mesh)
    flops = program_flops(program)
    routed = routed_expert_flops(cfg)
    S, pipe = mesh.shape["stage"], cfg.pipeline
    # SPMD stages compute in every iteration, bubble included: (V M + S - 1) / (V M)
    # (1F1B's stages skip the ops they do not run: no bubble computes)
    through_bubble = (1.0 / (1.0 - bubble_fraction(S, pipe.stage_microbatches,
                                                   pipe.virtual_stages))
                      if S > 1 and pipe.schedule != "1f1b" else 1.0)
    t = cfg.train
    tokens = t.batch_size * t.seq_len
    model_flops = flops_per_token(cfg) * tokens / n
    datasheet = TARGETS[device]
    counts = param_counts(cfg)
    kernels = step_kernels(mesh, cfg)
    bound = throughput_bound(model_flops, flops, moved, across, datasheet)
    roof = expected = None
    if target != "cpu":  # XLA:CPU's program is not the one a GPU would run
        host = hosts(mesh)
        link, measured = Link.of(datasheet), Link.of(datasheet, expected=True)
        walks = roofline(program, link, host), roofline(program, measured, host)
        roof, expected = (summary(w, model_flops, tokens / n, link) for w in walks)
        for walk, w in zip((roof, expected), walks):
            walk["quantisation"] = quantisation_cost(program, w)
            walk["xla_recomputed"] = xla_recomputation(w)
        expected["rates"] = measured.rates.generation
        # model FLOP/s as each anchor counts them
        by_count = {k: flops_per_token(cfg, k) * tokens / n for k in FLOP_COUNTS}
        for walk in (roof, expected):
            walk["model_tflops_by_count"] = {k: f / walk["step_s"] / 1e12
                                             for k, f in by_count.items()}
    compute_s = model_flops / (datasheet.peak("bf16") * mfu)
    comm_s = bound["scale_up_s"] + bound["scale_out_s"]  # the links one after the other
    return {
        "config": config_path, "target": target, "mesh": dict(mesh.shape), "devices": n,
        "device": device, "parallelism": cfg.mesh.parallelism, "dispatcher": cfg.moe.dispatcher,
        "step_program": "per-device" if uses_per_device_step(cfg) else "auto-sharded",
        "kernels": kernels,
        "params_total": counts.total, "params_active": counts.active,
        # what decoding keeps per token, all layers (MLA: latents and RoPE keys)
        "kv_cache_bytes_per_token": cache_bytes_per_token(cfg),
        "bytes_per_device": {"parameters": params, "optimizer_state": opt, "gradients": grads,
                             "activations_and_temporaries": mem.temp_size_in_bytes,
                             "peak": peak},
        "collective_bytes_per_step": moved,
        "collective_bytes_across_hosts": across,
        # ops that send anything: runs per step, and how many sit inside loops
        "collective_runs_per_step": {k: t.runs for k, t in traffic.items()},
        "collective_ops_in_loops": {k: t.ops_in_loops for k, t in traffic.items()},
        "model_flops_per_step_per_device": model_flops,
        # matrix products of the compiled program, by named scope and pass
        "program_flops_per_step_per_device": flops.by_scope,
        "program_flops_total": flops.total(),
        "unknown_kernels": flops.unknown_kernels,
        "loops_without_trip_count": len(program.loops_without_trip_count),
        "routed_expert_flops_forward": routed,
        "expert_gemm_flops_ratio": expert_gemm_ratios(flops.by_scope.get("expert_gemms", {}),
                                                      routed * through_bubble),
        "pipeline_compute_through_bubble": through_bubble,
        "predicted": {"compute_s": compute_s, "communication_s": comm_s,
                      "step_s_no_overlap": compute_s + comm_s,
                      "step_s_full_overlap": max(compute_s, comm_s),
                      "tokens_per_s_no_overlap": tokens / (compute_s + comm_s),
                      "tokens_per_s_full_overlap": tokens / max(compute_s, comm_s),
                      "model_tflops_per_device": [model_flops / (compute_s + comm_s) / 1e12,
                                                  model_flops / max(compute_s, comm_s) / 1e12]},
        "bound": bound,
        # the walk of the compiled program at the datasheet's peaks (a bound), and at the
        # rates GPUs of its generation measurably reach (`jaxmoe.plan.rates`)
        "roofline": roof,
        "expected": expected,
        "fits": peak <= datasheet.memory, "device_memory": datasheet.memory,
        "largest_buffers": buffers,
        # JAX preallocates 75% of a GPU unless XLA_PYTHON_CLIENT_MEM_FRACTION says more
        "memory_fraction_needed": peak / datasheet.memory,
        "assumptions": [f"compiled for {'fake CPU devices' if target == 'cpu' else target} "
                        f"({'XLA:CPU' if target == 'cpu' else 'XLA:GPU, deviceless'})",
                        f"{device}: {datasheet.memory / 1e9:.0f} GB, "
                        f"{datasheet.peak('bf16') / 1e12:.0f} dense bf16 TFLOP/s, "
                        f"{datasheet.scale_up / 1e9:.0f} GB/s per direction per GPU on NVLink, "
                        f"{datasheet.scale_out / 1e9:.0f} GB/s between hosts",
                        f"model FLOPs at {mfu:.0%} of peak", "every collective byte crosses a "
                        "link once (ring costs from each op's replica groups); between "
                        "hosts: an all-to-all's share for peers on other hosts, all of any "
                        "other collective whose groups span hosts; no overlap vs perfect "
                        "overlap bound the step",
                        "gradients counted in fp32 at their parameters' sharding"] + notes,
    }


def step_kernels(mesh, cfg) -> dict:
    """The device-dependent choices the compiled step made (`jaxmoe.ops.kernels`)."""
    from jaxmoe.ops.kernels import Kernels
    from jaxmoe.plan.targets import traced_on
    k = Kernels.of_mesh(mesh)
    ragged = cfg.num_moe_layers and cfg.moe.dispatcher == "ragged"
    with traced_on(k.device):  # as `compile_train_step` traced it
        attention = k.attention(cfg.model)
    return {"device_kind": k.device_kind, "attention": attention,
            "native_mxfp8": k.native_mxfp8 and "mxfp8" in (cfg.moe.expert_precision,
                                                            cfg.model.projection_precision),
            "ragged_exchange": ("native" if k.native_ragged_exchange else "cpu stand-in")
            if ragged else "-",
            # the experts' GEMM: a grouped kernel over the routed rows, or over buffers
            "expert_gemm": (k.grouped_gemm(cfg.moe, cfg.model.d_model) or "buffers")
            if cfg.num_moe_layers else "-"}


def print_plan(p: dict) -> None:
    gb = lambda b: f"{b / 1e9:,.2f} GB"  # noqa: E731
    print(f"{p['config']}  mesh {p['mesh']}  {p['parallelism']} + {p['dispatcher']} "
          f"({p['step_program']} step)  "
          f"({p['params_total'] / 1e9:.1f}B total, {p['params_active'] / 1e9:.2f}B active)")
    k = p["kernels"]
    print(f"  compiled for {p['target']} ({k['device_kind']}): attention {k['attention']}, "
          f"native MXFP8 {k['native_mxfp8']}, ragged exchange {k['ragged_exchange']}, "
          f"expert GEMM {k['expert_gemm']}")
    print(f"  decoding's KV cache {p['kv_cache_bytes_per_token']:,} bytes per token (every "
          "layer, in the compute dtype)")
    for key, v in p["bytes_per_device"].items():
        print(f"  {key:28s} {gb(v):>12s} per device")
    if p["largest_buffers"]:
        print("    largest temporaries (XLA's buffer assignment; the values that share "
              "each): " + ", ".join(f"{gb(b['bytes'])} {b['values']}"
                                   for b in p["largest_buffers"]))
    for key, v in p["collective_bytes_per_step"].items():
        across = p["collective_bytes_across_hosts"].get(key, 0)
        print(f"  {key + ' per step':28s} {gb(v):>12s} sent per device, "
              f"{p['collective_runs_per_step'][key]} runs, "
              f"{p['collective_ops_in_loops'][key]} ops in loops"
              + (f", {gb(across)} between hosts" if across else ""))
    print(f"  {'model FLOPs per step':28s} {p['model_flops_per_step_per_device']:.3e} per device")
    print(f"  {'program FLOPs per step':28s} {p['program_flops_total']:.3e} per device "
          "(matrix products; forward / backward / recompute):")
    for scope, by_pass in sorted(p["program_flops_per_step_per_device"].items(),
                                 key=lambda kv: -sum(kv[1].values())):
        parts = " / ".join(f"{by_pass.get(x, 0.0):.2e}" for x in ("forward", "backward", "recompute"))
        print(f"    {scope:26s} {sum(by_pass.values()):.3e}  ({parts})")
    if p["unknown_kernels"]:
        print(f"  kernels not counted: {p['unknown_kernels']}")
    if p["loops_without_trip_count"]:
        print(f"  {p['loops_without_trip_count']} loops without a known trip count, "
              "each counted once")
    ratio = p["expert_gemm_flops_ratio"]
    if ratio:
        per = ", ".join(f"{x} {v:.2f}" for x, v in ratio.items() if x != "max")
        print(f"  expert GEMM FLOPs / routed rows' {ratio['max']:.2f}x at most ({per})")
    if p["pipeline_compute_through_bubble"] > 1:
        print(f"  pipeline stages compute {p['pipeline_compute_through_bubble']:.3f}x the "
              "micro-batches' work (the bubble's iterations run too)")
    pr = p["predicted"]
    print(f"  predicted step {pr['step_s_full_overlap']:.2f}-{pr['step_s_no_overlap']:.2f} s, "
          f"{pr['tokens_per_s_no_overlap']:,.0f}-{pr['tokens_per_s_full_overlap']:,.0f} tokens/s, "
          f"{pr['model_tflops_per_device'][0]:,.0f}-{pr['model_tflops_per_device'][1]:,.0f} "
          "model TFLOP/s per device")
    b = p["bound"]
    count = p.get("reference_count") or "palm"
    reference = (f"; measured by the reference: {p['reference_tflops']:,.0f} in {count}'s "
                 "count" if p.get("reference_tflops") else "")
    print(f"  bound, not a measurement: at most {b['model_tflops_bound']:,.0f} model TFLOP/s "
          f"per device with perfect overlap, {b['model_tflops_no_overlap']:,.0f} with none"
          f"{reference}")
    fp8 = (f"{b['fp8_flops']:.2e} FLOPs at {b['fp8_peak'] / 1e12:,.0f} fp8 TFLOP/s, "
           if b["fp8_flops"] else "")
    print(f"    from: matrix products {b['compute_s_at_peak']:.2f} s at peak ({fp8}"
          f"{b['bf16_flops']:.2e} at {b['bf16_peak'] / 1e12:,.0f} bf16 TFLOP/s), NVLink "
          f"{b['scale_up_s']:.2f} s, network {b['scale_out_s']:.2f} s per step")
    if p["roofline"]:
        print_roofline(p["expected"], reference, expected=True, count=count)
        print_roofline(p["roofline"], reference, count=count)
    for a in p["assumptions"]:
        print(f"  assumes: {a}")
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    print(f"{verdict}: peak {gb(p['bytes_per_device']['peak'])} of "
          f"{gb(p['device_memory'])} on a {p['device'].upper()}")
    if p["fits"] and p["memory_fraction_needed"] > 0.75:
        fraction = math.ceil(p["memory_fraction_needed"] * 100) / 100
        print(f"  JAX preallocates 75% of a GPU by default: run with "
              f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction} or more")


def print_roofline(r: dict, reference: str = "", top: int = 6, expected: bool = False,
                   count: str = "palm") -> None:
    """The walk of the compiled program (`jaxmoe.plan.roofline`): the expected step, at
    measured rates, or the bound, at the datasheet's peaks; its parts, and where the
    time goes beyond the matrix products."""
    title = (f"expected step, at the rates {r['rates']} GPUs measurably reach "
             "(jaxmoe.plan.rates; a prediction, not a measurement)" if expected else
             "bound: the same program at the datasheet's peaks")
    tflops = r.get("model_tflops_by_count", {}).get(count, r["model_tflops_per_device"])
    others = ", ".join(f"{v:,.0f} in {k}'s" for k, v in r.get("model_tflops_by_count", {}).items()
                       if k != count)
    print(f"  {title}: step "
          f"{r['step_s']:.3f} s, {r['tokens_per_s_per_device']:,.0f} tokens/s per device, "
          f"{tflops:,.0f} model TFLOP/s per device in {count}'s count"
          + (f" ({others})" if others else "") + f", MFU {r['mfu']:.1%}{reference}")
    print(f"    kernels: matrix products {r['gemm_s']:.3f} s, memory-bound "
          f"{r['memory_bound_s']:.3f} s ({r['memory_bound_bytes']:.3g} bytes); collectives "
          f"{r['collective_s']:.3f} s, of "
          f"them {r['exposed_collective_s']:.3f} s exposed ({r['synchronous_collectives']} "
          "synchronous ops)")
    if r.get("host_transfer_bytes"):
        print(f"    host memory (offloaded activations): {r['host_transfer_bytes']:.3g} bytes "
              f"over the host link, {r['host_transfer_s']:.3f} s, of them "
              f"{r['exposed_host_s']:.3f} s exposed")
    q = r.get("quantisation") or {}
    if any(v["runs"] for v in q.values()):
        print("    MXFP8 quantisation kernels: " + ", ".join(
            f"{part} {v['seconds']:.3f} s ({v['bytes']:.3g} B in {v['runs']} runs)"
            for part, v in q.items()))
    x = r.get("xla_recomputed") or {}
    if x.get("runs"):
        print(f"    XLA recomputes to fit the device's memory (its rematerialisation, beyond "
              f"the remat policy): {x['kernels']} kernels, {x['seconds']:.3f} s "
              f"({x['bytes']:.3g} B in {x['runs']} runs)")
    for title, rows, key in (("memory-bound kernels", r["memory_bound_by_scope"], "seconds"),
                             ("exposed collectives", r["exposed_by_scope"], "exposed_s")):
        shown = [(k, v) for k, v in list(rows.items())[:top] if v[key] > 0]
        if shown:
            print(f"    {title} by scope/pass: " + ", ".join(
                f"{k} {v[key]:.3f} s" + (f" ({v['bytes']:.2g} B)" if "bytes" in v else "")
                for k, v in shown))
    if expected:
        return
    print("    assumes: each kernel at max(FLOPs / peak, bytes / HBM bandwidth) at the "
          "datasheet's peaks (fp8 operands at the fp8 peak, fp32 at half the bf16); each "
          "collective at its link's bandwidth plus a fixed latency, one at a time, async ones "
          "beside the kernels the schedule put in their window; the expected step walks the "
          "same schedule with each at its measured fraction, plus a launch cost per kernel; "
          "neither knows caches or contention between kernels and collectives")


def build_parser() -> argparse.ArgumentParser:
    """The arguments of `python -m jaxmoe.plan`; docs/reference/commands.md is generated from
    them."""
    parser = argparse.ArgumentParser(prog="python -m jaxmoe.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--mesh", help="e.g. data=1,expert=8 (overrides the config's mesh)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--target", default="cpu", choices=["cpu", *sorted(TARGETS)],
                        help="the compiler: a GPU (XLA:GPU, no GPU needed) or fake CPU devices")
    parser.add_argument("--device", choices=sorted(TARGETS),
                        help="the datasheet to judge against (default: the target; h100 for cpu)")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model-FLOPs utilisation")
    parser.add_argument("--json", help="write the plan to this file")
    parser.add_argument("--reference-tflops", type=float,
                        help="a measured model TFLOP/s per GPU to print beside the bound")
    parser.add_argument("--reference-count", choices=FLOP_COUNTS,
                        default="palm", help="how the reference counts model FLOPs: "
                        "jaxmoe's figures beside it are printed in the same count")
    parser.add_argument("--search", action="store_true",
                        help="rank the layouts (mesh, pipeline, remat, dispatcher) by expected "
                             "step on --target, compiling each (jaxmoe.plan.search)")
    parser.add_argument("--devices", type=int,
                        help="--search: the devices to lay out (default: the config's mesh)")
    parser.add_argument("--axes", default="data,stage,expert,context",
                        help="--search: the mesh axes to lay the devices over (others stay 1)")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="--search: stop compiling candidates after this many seconds")
    parser.add_argument("--micro-batch", type=int,
                        help="--search: hold the sequences per GPU per pass at this (each "
                             "layout's accumulation slices set to give it)")
    parser.add_argument("--only", action="append", default=[], metavar="CHOICE=V1,V2",
                        help="--search: only these values of a choice (data, stage, expert, "
                             "context, stage_microbatches, virtual_stages, remat, dispatcher); "
                             "repeatable, e.g. --only expert=8 --only remat=full,save_attention")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.target != "cpu" and args.device not in (None, args.target):
        parser.error(f"--device {args.device} with --target {args.target}: a GPU target is "
                     "judged against its own datasheet")
    device = args.device or (args.target if args.target != "cpu" else "h100")
    overrides = args.set + _parse_mesh(args.mesh)

    from jaxmoe.config import ConfigError, load_config
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sizes = [getattr(cfg.mesh, a) for a in AXES]
    if args.search:
        return _search(cfg, args, sizes)
    if -1 in sizes:
        print("error: mesh: the planner needs every mesh axis given (no -1); use --mesh",
              file=sys.stderr)
        return 2
    if args.target != "cpu" and not gpu_compiler_available():
        print(f"error: --target {args.target} needs the GPU compiler: {EXTRA}", file=sys.stderr)
        return 2
    # Before JAX starts: the fake CPU devices, and JAX_PLATFORMS=cpu, without which the
    # CUDA plugin would look for a GPU rather than offer its deviceless topology.
    if "jax" not in sys.modules:
        os.environ.update(cpu_devices_env(os.environ, math.prod(sizes)))
    try:
        result = plan(args.config, overrides, args.target, device, args.mfu)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["reference_tflops"] = args.reference_tflops
    result["reference_count"] = args.reference_count
    print_plan(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _search(cfg, args, sizes: list[int]) -> int:
    from jaxmoe.plan.search import CHOICES, print_search, search
    devices = args.devices or (math.prod(sizes) if -1 not in sizes else None)
    if devices is None or devices < 1:
        print("error: --search needs --devices N (the config's mesh leaves an axis at -1)",
              file=sys.stderr)
        return 2
    if args.target == "cpu":
        print("error: --search ranks by the expected step on a GPU: give --target",
              file=sys.stderr)
        return 2
    if not gpu_compiler_available():
        print(f"error: --search needs the GPU compiler: {EXTRA}", file=sys.stderr)
        return 2
    if "jax" not in sys.modules:
        os.environ.update(cpu_devices_env(os.environ, 1))

    def progress(i: int, n: int, candidate) -> None:
        print(f"  [{i + 1}/{n}] compiling {candidate} ...", flush=True)

    print(f"searching the layouts of {args.config} on {devices} virtual "
          f"{args.target.upper()}s (XLA:GPU), at most {args.budget_s:.0f} s of compiling",
          flush=True)
    axes = tuple(a.strip() for a in args.axes.split(",") if a.strip())
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        print(f"error: --axes: {unknown} are not mesh axes {list(AXES)}", file=sys.stderr)
        return 2
    only = {}
    for item in args.only:
        key, _, values = item.partition("=")
        key = key.strip()
        if key not in CHOICES or not values.strip():
            print(f"error: --only {item!r}: expected CHOICE=V1,V2 with CHOICE one of "
                  f"{list(CHOICES)}", file=sys.stderr)
            return 2
        parts = [v.strip() for v in values.split(",") if v.strip()]
        if key not in ("remat", "dispatcher", "schedule"):
            if not all(v.isdigit() and int(v) > 0 for v in parts):
                print(f"error: --only {item!r}: {key} takes positive whole numbers",
                      file=sys.stderr)
                return 2
            parts = [int(v) for v in parts]
        if not parts:
            print(f"error: --only {item!r}: no values", file=sys.stderr)
            return 2
        if key in AXES and key not in axes:
            print(f"error: --only {item!r}: {key} is not among --axes {','.join(axes)}",
                  file=sys.stderr)
            return 2
        only[key] = tuple(parts)
    if args.micro_batch is not None and args.micro_batch < 1:
        print(f"error: --micro-batch {args.micro_batch}: must be at least 1", file=sys.stderr)
        return 2
    rows, refused = search(cfg, devices, args.target, args.budget_s, progress, axes=axes,
                           micro_batch=args.micro_batch, only=only)
    print_search(rows, refused)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"layout": str(r.candidate), "overrides": r.candidate.overrides(),
                        "static_bytes": r.static_bytes, "peak_bytes": r.peak_bytes,
                        "expected_step_s": r.expected_step_s, "bound_step_s": r.bound_step_s,
                        "tokens_per_s_per_device": r.tokens_per_s_per_device, "fits": r.fits,
                        "why_not": r.why_not, "compile_s": r.compile_s} for r in rows], f,
                      indent=2)
    return 0 if rows and rows[0].fits else 1


if __name__ == "__main__":
    sys.exit(main())
