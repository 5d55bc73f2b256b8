"""The shipped GPU configs' programs, compiled without a GPU: one row of figures each.

    JAX_PLATFORMS=cpu python benchmarks/gpu_programs.py [NAME ... | anchors] [--json FILE]
        [--set KEY=VALUE ...]

Compiles each train step for its target with XLA:GPU's deviceless compiler
(`jaxmoe.plan`) and prints, per program: the JAX and tokamax it was built with, the
peak memory, the roofline's predicted step, the memory-bound kernels' bytes, the
exposed collectives and the expert GEMMs' FLOPs over the routed rows'; then the
expected step (the same walk at the rates GPUs measurably reach, `jaxmoe.plan.rates`)
beside the bound, in each anchor's FLOP count, with its three largest parts. Run it under
two JAX releases (or before and after a change) to set their programs side by side;
it reads nothing but `jaxmoe.plan.planner.plan`'s figures, so it also runs against an
older checkout, whose configs it then compiles (`PYTHONPATH=OLD_CHECKOUT python
benchmarks/gpu_programs.py`). `anchors` compiles each measured run's config
(`jaxmoe.plan.anchors`) for its GPU and prints jaxmoe's expected figure beside the
measured one, in the anchor's count.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin compiles, nothing runs
if __name__ == "__main__" and "jaxmoe" not in os.environ.get("PYTHONPATH", ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxmoe  # noqa: E402

ROOT = Path(jaxmoe.__file__).resolve().parents[1]  # the checkout whose configs are compiled

# name -> (config, target, planner --set overrides)
PROGRAMS = {
    "47b_b300": ("configs/olmoe_8layer_e128.yaml", "b300", ["mesh.data=1", "mesh.expert=8"]),
    "47b_h200": ("configs/olmoe_8layer_e128.yaml", "h200", ["mesh.data=1", "mesh.expert=8"]),
    "47b_b200": ("configs/olmoe_8layer_e128.yaml", "b200", ["mesh.data=1", "mesh.expert=8"]),
    "47b_h100": ("configs/olmoe_8layer_e128.yaml", "h100", ["mesh.data=1", "mesh.expert=8"]),
    "1200b_b300": ("configs/moe_1200b_512gpu.yaml", "b300", []),
    "671b_b300": ("configs/deepseek_v3_671b.yaml", "b300", []),
    # MaxText + TE's row: 128 GB300s, two NVL72 racks; the exchange within a rack
    "671b_gb300": ("configs/deepseek_v3_671b.yaml", "gb300",
                   ["mesh.data=2", "mesh.stage=1", "mesh.expert=64",
                    "pipeline.virtual_stages=1", "pipeline.stage_microbatches=1"]),
    "small_h100": ("configs/gpu1_small.yaml", "h100", []),
    "2400b_b300": ("configs/moe_2400b_512gpu.yaml", "b300", []),
    "47b_131k_b300": ("configs/olmoe_8layer_e128_131k.yaml", "b300", []),
}
try:  # the measured runs' configs, each on its own GPU (a checkout without them has none)
    from jaxmoe.plan.anchors import ANCHORS, anchor_for
    try:
        from jaxmoe.plan.counts import FLOP_COUNTS
    except ImportError:  # a checkout from before the counts joined the planner
        from jaxmoe.config import FLOP_COUNTS
except ImportError:
    FLOP_COUNTS, ANCHORS, anchor_for = (), (), lambda name: None
PROGRAMS.update({a.config: (f"configs/{a.config}.yaml", a.target, []) for a in ANCHORS})


# the programs a release is compared on (the 47B on a B200 and an H100 on request)
DEFAULT = ["small_h100", "47b_b300", "47b_h200", "1200b_b300", "671b_b300"]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def config_digest(path: str, overrides: list[str]) -> str:
    """SHA-256 of the values a config sets away from the defaults (its comments and
    layout left out, and a key added later at its default changes no digest)."""
    from jaxmoe.config import Config, load_config

    defaults = Config().to_dict()
    chosen = {section: {k: v for k, v in keys.items() if defaults[section].get(k) != v}
              for section, keys in load_config(path, overrides).to_dict().items()}
    values = json.dumps(chosen, sort_keys=True, default=str)
    return hashlib.sha256(values.encode()).hexdigest()


def figures(name: str, extra: list[str] = ()) -> dict:
    """extra: config overrides after the program's own (`--set`)."""
    from jaxmoe.plan.planner import plan

    config, target, overrides = PROGRAMS[name]
    overrides = [*overrides, *extra]
    start = time.perf_counter()
    p = plan(str(ROOT / config), overrides, target, target, 0.4)
    roof, expected = p["roofline"], p.get("expected") or {}
    parts = {"matrix products": expected.get("gemm_s", 0.0),
             "memory-bound kernels": expected.get("memory_bound_s", 0.0),
             "exposed collectives": expected.get("exposed_collective_s", 0.0)}
    if expected.get("exposed_host_s"):  # offloaded activations the step waits for
        parts["exposed host copies"] = expected["exposed_host_s"]
    return {"program": name, "jax": _version("jax"), "tokamax": _version("tokamax"),
            # what the figures were compiled from: a docs page built from them checks
            # that the config's values have not changed since (docs/generate.py)
            "config": config, "target": target, "overrides": overrides,
            "config_digest": config_digest(str(ROOT / config), overrides),
            "date": datetime.date.today().isoformat(),
            "devices": p["devices"], "mesh": p["mesh"],
            "params_total": p["params_total"], "params_active": p["params_active"],
            "device_memory_gb": p["device_memory"] / 1e9,
            "memory_fraction_needed": p["memory_fraction_needed"],
            "peak_gb": p["bytes_per_device"]["peak"] / 1e9,
            "step_s": roof["step_s"],
            "model_tflops_per_device": roof["model_tflops_per_device"],
            "tokens_per_s_per_device": roof["tokens_per_s_per_device"],
            "fits": p["fits"],
            "memory_bound_bytes": roof["memory_bound_bytes"],
            "memory_bound_s": roof["memory_bound_s"],
            "exposed_collective_s": roof["exposed_collective_s"],
            "synchronous_collectives": roof["synchronous_collectives"],
            "expert_gemm_over_routed": p["expert_gemm_flops_ratio"].get("max"),
            "expert_gemm": p["kernels"]["expert_gemm"],
            "exposed_by_scope": {k: v for k, v in roof["exposed_by_scope"].items()
                                 if v["exposed_s"] > 1e-3},
            "memory_bound_by_scope": dict(list(roof["memory_bound_by_scope"].items())[:8]),
            "expected_step_s": expected.get("step_s"),
            "expected_tokens_per_s_per_device": expected.get("tokens_per_s_per_device"),
            "expected_tflops_by_count": expected.get("model_tflops_by_count", {}),
            "bound_tflops_by_count": roof.get("model_tflops_by_count", {}),
            "expected_parts_s": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
            "kernel_runs": expected.get("kernel_runs"),
            "quantisation": expected.get("quantisation"),
            "compile_s": time.perf_counter() - start}


def row(f: dict) -> str:
    ratio = f["expert_gemm_over_routed"]
    return (f"| {f['program']} | {f['jax']} | {f['tokamax']} | {f['peak_gb']:.2f} GB "
            f"| {f['step_s']:.3f} s | {f['model_tflops_per_device']:,.0f} "
            f"| {f['memory_bound_bytes']:.3e} | {f['exposed_collective_s']:.3f} s "
            f"({f['synchronous_collectives']} sync) "
            f"| {'-' if ratio is None else f'{ratio:.2f}x'} ({f['expert_gemm']}) |")


def expected_row(f: dict) -> str:
    e, b = f["expected_tflops_by_count"], f["bound_tflops_by_count"]
    if not e:
        return f"| {f['program']} | (figures without rates: an older checkout) |"
    parts = ", ".join(f"{k} {v:.3f} s" for k, v in f["expected_parts_s"].items())
    return (f"| {f['program']} | {f['expected_step_s']:.3f} s ({f['step_s']:.3f} s) "
            f"| {f['expected_tokens_per_s_per_device']:,.0f} "
            f"({f['tokens_per_s_per_device']:,.0f}) "
            + " ".join(f"| {e[k]:,.0f} ({b[k]:,.0f})" for k in FLOP_COUNTS)
            + f" | {parts} |")


def anchor_row(f: dict) -> str:
    """The anchor's measured figure beside jaxmoe's expected one and the bound, in its unit
    and count, with the expected step's three largest parts."""
    a = anchor_for(f["program"])
    if a.unit == "tokens/s":
        expected, bound = f["expected_tokens_per_s_per_device"], f["tokens_per_s_per_device"]
    else:
        expected = f["expected_tflops_by_count"][a.count]
        bound = f["bound_tflops_by_count"][a.count]
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in f["expected_parts_s"].items())
    fits = "" if f["fits"] else f" (does not fit: {f['peak_gb']:.0f} GB)"
    names = {"palm": "PaLM's", "megatron": "Megatron's", "maxtext": "MaxText's"}
    count = f" ({names[a.count]} count)" if a.unit == "TFLOP/s" else ""
    return (f"| {a.who}, {a.gpus} {a.target.upper()} | {a.measured:,.0f} {a.unit}{count} "
            f"| {expected:,.0f}{fits} | {bound:,.0f} | {expected / a.measured:.2f}x "
            f"| {f['expected_step_s']:.2f} s: {parts} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=DEFAULT, metavar="NAME",
                        help=f"programs to compile (default: {', '.join(DEFAULT)}; any of "
                             f"{', '.join(PROGRAMS)}; or anchors: every measured run's config)")
    parser.add_argument("--json", help="append each program's figures to this file, a line each")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every program, after its own (repeatable): "
                             "e.g. --set pipeline.schedule=1f1b --set train.remat=full")
    args = parser.parse_args(argv)
    if args.names == ["anchors"]:
        args.names = [a.config for a in ANCHORS]
    unknown = [n for n in args.names if n not in PROGRAMS]
    if unknown:
        parser.error(f"unknown program(s) {unknown}; choose from {list(PROGRAMS)}")
    rows, expected, figures_seen = [], [], []
    for name in args.names:
        f = figures(name, args.set)
        figures_seen.append(f)
        rows.append(row(f))
        expected.append(expected_row(f))
        print(rows[-1], flush=True)
        if args.json:
            with open(args.json, "a") as out:
                out.write(json.dumps(f) + "\n")
    print("| program | jax | tokamax | peak | step | model TFLOP/s | memory-bound bytes "
          "| exposed collectives | expert GEMMs / routed |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| program | expected step (bound) | tokens/s per GPU | model TFLOP/s per GPU, "
          "PaLM's count | Megatron's | MaxText's | expected step's parts |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(expected))
    anchored = [f for f in figures_seen if anchor_for(f["program"])]
    if anchored:
        print()
        print("| anchor | measured per GPU | jaxmoe expected, same count | bound | expected / "
              "measured | expected step's largest parts |")
        print("|---|---|---|---|---|---|")
        print("\n".join(anchor_row(f) for f in anchored))
    return 0


if __name__ == "__main__":
    sys.exit(main())
