"""Plots of a run's expert load: `python -m jaxmoe.observe.plots RUN_DIR` writes PNGs there.

- load_heatmaps: per MoE layer, each expert's load (relative to the mean) over steps;
- balance_vs_imbalance: the Switch balance loss against the true max/mean load,
  the picture that shows token gerrymandering when the two part ways.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The run's logged steps that carry expert-load metrics."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "expert_load" in r]
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no expert-load records (no MoE layers?)")
    return records


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def load_heatmaps(run_dir: str | Path, out: str | Path | None = None) -> Path:
    records = read_metrics(run_dir)
    steps = [r["step"] for r in records]
    Lm = len(records[0]["load_max_over_mean"])
    # one row per logged step (record)
    load_RecxLmxE = np.array([r["expert_load"] for r in records]).reshape(len(records), Lm, -1)
    plt = _pyplot()
    fig, axes = plt.subplots(Lm, 1, figsize=(8, 1.8 * Lm + 0.6), squeeze=False, sharex=True)
    vmax = max(2.0, float(load_RecxLmxE.max()))
    for layer, ax in enumerate(axes[:, 0]):
        im = ax.imshow(load_RecxLmxE[:, layer].T, aspect="auto", cmap="magma", vmin=0, vmax=vmax,
                       extent=(steps[0], steps[-1], load_RecxLmxE.shape[2] - 0.5, -0.5),
                       interpolation="nearest")
        ax.set_ylabel(f"MoE layer {layer}\nexpert")
    axes[-1, 0].set_xlabel("step")
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="load / mean load")
    fig.suptitle("expert load (requested tokens, global batch); 0 = dead expert")
    out = Path(out or Path(run_dir) / "expert_load.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def balance_vs_imbalance(run_dir: str | Path, out: str | Path | None = None) -> Path:
    records = read_metrics(run_dir)
    steps = [r["step"] for r in records]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, [r["balance_loss"] for r in records], color="tab:blue", label="balance loss")
    ax.set_xlabel("step")
    ax.set_ylabel("Switch balance loss (1 = uniform)", color="tab:blue")
    twin = ax.twinx()
    twin.plot(steps, [max(r["load_max_over_mean"]) for r in records], color="tab:red",
              label="max/mean load (worst layer)")
    twin.plot(steps, [max(r["dead_experts"]) for r in records], color="tab:gray", ls="--",
              label="dead experts (worst layer)")
    twin.set_ylabel("true imbalance", color="tab:red")
    fig.legend(loc="upper right")
    fig.suptitle("balance loss vs true load imbalance")
    fig.tight_layout()
    out = Path(out or Path(run_dir) / "balance_vs_load.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The arguments of `python -m jaxmoe.observe.plots`; docs/reference/commands.md is
    generated from them."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxmoe.observe.plots",
        description="Draw a run's per-layer expert-load heatmaps (expert_load.png) and its "
                    "balance loss against the true imbalance (balance_vs_load.png) into the "
                    "run directory.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with metrics.jsonl")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (Path(args.run_dir) / "metrics.jsonl").is_file():
        print(f"error: {Path(args.run_dir) / 'metrics.jsonl'} does not exist; give a run "
              "directory", file=sys.stderr)
        return 2
    for path in (load_heatmaps(args.run_dir), balance_vs_imbalance(args.run_dir)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
