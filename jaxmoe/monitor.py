"""Where metrics go: a JSON-lines file and a progress bar."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm import tqdm


def to_python(metrics: dict) -> dict:
    """Device arrays -> JSON-friendly floats and lists, rounded for reading."""
    out = {}
    for k, v in metrics.items():
        a = np.asarray(v)
        out[k] = float(a) if a.ndim == 0 else [float(x) for x in a.ravel()]
    return out


class Monitor:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, progress: bool):
        self.file = open(run_dir / "metrics.jsonl", "a")
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not progress,
                        dynamic_ncols=True, unit="step")

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def progress(self, steps: int, record: dict) -> None:
        text = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
        if "load_max_over_mean" in record:
            worst = max(record["load_max_over_mean"])
            text["max/mean load"] = f"{worst:.2f}"
        if "drop_fraction" in record:
            text["drop"] = f"{max(record['drop_fraction']):.1%}"
        self.bar.set_postfix(text, refresh=False)
        self.bar.update(steps)

    def write(self, line: str) -> None:
        self.bar.write(line)

    def close(self) -> None:
        self.bar.close()
        self.file.close()
