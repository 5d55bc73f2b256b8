"""Where metrics go: a JSON-lines file, a progress bar and the configured sinks
(process 0's; other processes stay quiet)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxmoe.observe.gerrymandering import (gerrymandering, recent_history, settle_step,
                                 steady_gerrymandering)


def to_python(metrics: dict) -> dict:
    """Device arrays -> JSON-friendly floats and lists, rounded for reading."""
    out = {}
    for k, v in metrics.items():
        a = np.asarray(v)
        out[k] = float(a) if a.ndim == 0 else [float(x) for x in a.ravel()]
    return out


def superseded(path: Path, step: int) -> None:
    """A resumed run's metrics.jsonl without the records of steps after `step` (a
    crash after the checkpoint it resumes from logged them, and the run logs them
    again); they move to metrics.superseded.jsonl, nothing is lost."""
    if not path.exists():
        return
    keep, later = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            after = json.loads(line).get("step", 0) > step
        except (ValueError, AttributeError):  # a line cut short by the crash
            after = True
        (later if after else keep).append(line)
    if later:
        with open(path.with_name("metrics.superseded.jsonl"), "a") as f:
            f.writelines(later)
        path.write_text("".join(keep))


class Monitor:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, progress: bool,
                 sinks: list = (), active: bool = True):
        self.active = active
        if active and start_step:
            superseded(run_dir / "metrics.jsonl", start_step)
        self.file = open(run_dir / "metrics.jsonl", "a") if active else None
        self.sinks = list(sinks)  # see jaxmoe.observe.sinks
        self.closed = False
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not (progress and active),
                        dynamic_ncols=True, unit="step")
        self.balance_history: list[dict] = []  # the last logged records the checks read
        self.settle_step = settle_step(total_steps)
        self.flagged: set[str] = set()  # the kinds of gerrymandering already reported

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for sink in self.sinks:
            sink.log(record)

    def progress(self, steps: int, record: dict) -> None:
        text = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
        if "mfu" in record:
            text["mfu"] = f"{record['mfu']:.1%}"
        memory = record.get("device_memory_peak_gb", record.get("host_memory_peak_gb"))
        if memory is not None:
            text["mem"] = f"{memory:.1f}GB"
        if "data_epoch" in record:
            text["epoch"] = f"{record['data_epoch']:.2f}"
        if "load_max_over_mean" in record:  # the worst MoE layer, at a glance
            worst = max(range(len(record["load_max_over_mean"])),
                        key=lambda i: record["load_max_over_mean"][i])
            text["load"] = (f"L{worst} max/mean {record['load_max_over_mean'][worst]:.2f} "
                            f"dead {int(max(record['dead_experts']))} "
                            f"drop {max(record['drop_fraction']):.1%}")
            if any(record.get("balance_loss_scaled", [])):  # only a trained loss can be gamed
                self._watch_balance(record)
        self.bar.set_postfix(text, refresh=False)
        self.bar.update(steps)

    def _watch_balance(self, record: dict) -> None:
        """Reports each kind of gerrymandering once: to the log, and as a record
        whose text goes to metrics.jsonl and whose per-layer flag goes to the sinks."""
        self.balance_history = recent_history(self.balance_history + [record])
        checks = {"falling": gerrymandering(self.balance_history),
                  "steady": steady_gerrymandering(self.balance_history, self.settle_step)}
        for kind, found in checks.items():
            if found is None or kind in self.flagged:
                continue
            self.flagged.add(kind)
            layer, warning = found
            self.write(f"warning at step {record['step']}: {warning}")
            flag_L = [float(i == layer) for i in range(len(record["load_max_over_mean"]))]
            self.log({"step": record["step"], "warning": warning, f"gerrymander_{kind}": flag_L})

    def write(self, line: str) -> None:
        if self.active:
            self.bar.write(line)

    def close(self) -> None:
        """Closes the bar, the file and the sinks, once however often it is called."""
        if self.closed:
            return
        self.closed = True
        self.bar.close()
        if self.active:
            self.file.close()
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
