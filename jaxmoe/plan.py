"""python -m jaxmoe.plan --config X [--mesh data=1,expert=8] [--device b300] [--json FILE]

Proves (or refutes) that a configuration fits, without allocating the model:
lowers and compiles the real train step against abstract inputs on fake CPU
devices, one per device of the mesh, and reads per device from the compiled
program: parameter, optimizer-state, gradient and activation memory and the
peak; the bytes each kind of collective moves per step; FLOPs per step. From a
device's datasheet it predicts step time and tokens/s, printing its assumptions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass

from jaxmoe.fake_devices import cpu_devices_env


@dataclass(frozen=True)
class Device:
    memory: float  # bytes of device memory
    bf16_flops: float  # dense bf16 FLOP/s (datasheet, no sparsity)
    link: float  # bytes/s per direction on the scale-up link (NVLink)


# Datasheet figures; a prediction is only as good as these and the MFU assumed.
DEVICES = {
    "b300": Device(288e9, 2.25e15, 900e9),
    "b200": Device(180e9, 2.25e15, 900e9),
    "h200": Device(141e9, 0.989e15, 450e9),
    "h100": Device(80e9, 0.989e15, 450e9),
    "a100": Device(80e9, 0.312e15, 300e9),
}


def _parse_mesh(text: str | None) -> list[str]:
    if not text:
        return []
    out = []
    for part in text.split(","):
        axis, _, value = part.partition("=")
        if axis.strip() not in ("data", "expert", "stage") or not value.strip().lstrip("-").isdigit():
            raise SystemExit(f"error: --mesh takes data=N,expert=N,stage=N; got {part!r}")
        out.append(f"mesh.{axis.strip()}={int(value)}")
    return out


def plan(config_path: str, overrides: list[str], device: str, mfu: float) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxmoe import checkpoint
    from jaxmoe.config import flops_per_token, load_config, param_counts
    from jaxmoe.parallel.collectives import compiled_collectives, totals
    from jaxmoe.sharding import make_mesh
    from jaxmoe.step import build_steps, uses_per_device_step

    # what XLA:CPU cannot compile, or would compile far bigger than a GPU runs it
    notes, stand_ins = [], []
    cfg = load_config(config_path, overrides)
    if cfg.moe.dispatcher == "ragged":
        stand_ins += ["moe.dispatcher=alltoall", "moe.capacity_factor=1.0"]
        notes.append("compiled with the alltoall dispatcher at capacity 1.0 in place of ragged "
                     "(on CPU ragged runs through a padded stand-in exchange that moves R x the "
                     "routed rows; alltoall moves the same tokens as ragged at uniform load)")
    if not cfg.model.attention_block and cfg.train.seq_len % 512 == 0:
        stand_ins.append("model.attention_block=512")
        notes.append("attention compiled blockwise (512 x 512 score blocks) in place of the GPU's "
                     "fused kernel: neither holds the L x L scores, as XLA:CPU's would")
    cfg = load_config(config_path, overrides + stand_ins)
    mesh = make_mesh(cfg.mesh)
    steps = build_steps(cfg, mesh)
    target = checkpoint.abstract_target(steps)
    t = cfg.train
    batch = jax.ShapeDtypeStruct((t.batch_size, t.seq_len + 1), jnp.int32,
                                 sharding=steps.batch_sharding)
    compiled = steps.train_step.lower(target, batch).compile()
    mem = compiled.memory_analysis()

    def per_device(tree) -> int:
        return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                   for a in jax.tree.leaves(tree))

    n = mesh.size
    params = per_device(target.params)
    opt = per_device(target.opt_state)
    grads = params  # fp32, laid out like the master weights they update
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes \
        + mem.temp_size_in_bytes
    traffic = totals(compiled_collectives(compiled))
    moved = {k: t.bytes for k, t in traffic.items()}
    tokens = t.batch_size * t.seq_len
    model_flops = flops_per_token(cfg) * tokens / n
    spec = DEVICES[device]
    compute_s = model_flops / (spec.bf16_flops * mfu)
    comm_s = sum(moved.values()) / spec.link
    counts = param_counts(cfg)
    return {
        "config": config_path, "mesh": dict(mesh.shape), "devices": n, "device": device,
        "parallelism": cfg.mesh.parallelism, "dispatcher": cfg.moe.dispatcher,
        "step_program": "per-device" if uses_per_device_step(cfg) else "auto-sharded",
        "params_total": counts.total, "params_active": counts.active,
        "bytes_per_device": {"parameters": params, "optimizer_state": opt, "gradients": grads,
                             "activations_and_temporaries": mem.temp_size_in_bytes,
                             "peak": peak},
        "collective_bytes_per_step": moved,
        # ops that send anything: runs per step, and how many sit inside loops
        "collective_runs_per_step": {k: t.runs for k, t in traffic.items()},
        "collective_ops_in_loops": {k: t.ops_in_loops for k, t in traffic.items()},
        "model_flops_per_step_per_device": model_flops,
        "predicted": {"compute_s": compute_s, "communication_s": comm_s,
                      "step_s_no_overlap": compute_s + comm_s,
                      "step_s_full_overlap": max(compute_s, comm_s),
                      "tokens_per_s_no_overlap": tokens / (compute_s + comm_s),
                      "tokens_per_s_full_overlap": tokens / max(compute_s, comm_s),
                      "model_tflops_per_device": [model_flops / (compute_s + comm_s) / 1e12,
                                                  model_flops / max(compute_s, comm_s) / 1e12]},
        "fits": peak <= spec.memory, "device_memory": spec.memory,
        "assumptions": [f"{device}: {spec.memory / 1e9:.0f} GB, {spec.bf16_flops / 1e12:.0f} "
                        f"dense bf16 TFLOP/s, {spec.link / 1e9:.0f} GB/s per direction per link",
                        f"model FLOPs at {mfu:.0%} of peak", "every collective byte crosses the "
                        "scale-up link once (ring costs from each op's replica groups); no "
                        "overlap vs perfect overlap bound the step",
                        "gradients counted in fp32 at their parameters' sharding"] + notes,
    }


def print_plan(p: dict) -> None:
    gb = lambda b: f"{b / 1e9:,.2f} GB"  # noqa: E731
    print(f"{p['config']}  mesh {p['mesh']}  {p['parallelism']} + {p['dispatcher']} "
          f"({p['step_program']} step)  "
          f"({p['params_total'] / 1e9:.1f}B total, {p['params_active'] / 1e9:.2f}B active)")
    for k, v in p["bytes_per_device"].items():
        print(f"  {k:28s} {gb(v):>12s} per device")
    for k, v in p["collective_bytes_per_step"].items():
        print(f"  {k + ' per step':28s} {gb(v):>12s} sent per device, "
              f"{p['collective_runs_per_step'][k]} runs, {p['collective_ops_in_loops'][k]} ops in loops")
    print(f"  {'model FLOPs per step':28s} {p['model_flops_per_step_per_device']:.3e} per device")
    pr = p["predicted"]
    print(f"  predicted step {pr['step_s_full_overlap']:.2f}-{pr['step_s_no_overlap']:.2f} s, "
          f"{pr['tokens_per_s_no_overlap']:,.0f}-{pr['tokens_per_s_full_overlap']:,.0f} tokens/s, "
          f"{pr['model_tflops_per_device'][0]:,.0f}-{pr['model_tflops_per_device'][1]:,.0f} "
          "model TFLOP/s per device")
    for a in p["assumptions"]:
        print(f"  assumes: {a}")
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    print(f"{verdict}: peak {gb(p['bytes_per_device']['peak'])} of "
          f"{gb(p['device_memory'])} on a {p['device'].upper()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxmoe.plan", description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--mesh", help="e.g. data=1,expert=8 (overrides the config's mesh)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--device", default="h100", choices=sorted(DEVICES))
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model-FLOPs utilisation")
    parser.add_argument("--json", help="write the plan to this file")
    args = parser.parse_args(argv)
    overrides = args.set + _parse_mesh(args.mesh)

    # Fake CPU devices must exist before jax starts: count the mesh from the config.
    from jaxmoe.config import ConfigError, load_config
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sizes = [cfg.mesh.data, cfg.mesh.expert, cfg.mesh.stage]
    if -1 in sizes:
        print("error: mesh: the planner needs every mesh axis given (no -1); use --mesh",
              file=sys.stderr)
        return 2
    if "jax" not in sys.modules:
        os.environ.update(cpu_devices_env(os.environ, math.prod(sizes)))
    try:
        result = plan(args.config, overrides, args.device, args.mfu)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_plan(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
