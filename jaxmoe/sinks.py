"""Optional metric sinks beside metrics.jsonl: TensorBoard event files and W&B offline runs.

Chosen with `logging.tensorboard` / `logging.wandb`; each needs its package, from
the matching extra (pip install "jaxmoe[tensorboard]", "jaxmoe[wandb]"). Every
logged record goes to each sink: per-layer lists become one scalar per MoE layer
(`load_max_over_mean/layer0`, ...) and `expert_load` one histogram per layer.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np

from jaxmoe.config import Config, ConfigError

PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb"}


def _import(sink: str):
    try:
        return importlib.import_module(PACKAGES[sink])
    except ImportError:
        raise ConfigError(f"logging.{sink}: needs the {PACKAGES[sink]} package, which is not "
                          f"installed; pip install \"jaxmoe[{sink}]\"") from None


def check_available(cfg: Config) -> None:
    """Fails before training starts when a chosen sink's package is missing."""
    for sink in PACKAGES:
        if getattr(cfg.logging, sink):
            _import(sink)


def scalars(record: dict) -> dict[str, float]:
    out = {}
    for key, value in record.items():
        if key in ("step", "expert_load") or isinstance(value, str):  # text stays in metrics.jsonl
            continue
        if isinstance(value, list):
            out |= {f"{key}/layer{i}": v for i, v in enumerate(value)}
        else:
            out[key] = value
    return out


def histograms(record: dict) -> dict[str, np.ndarray]:
    if "expert_load" not in record:
        return {}
    load_LxE = np.reshape(record["expert_load"], (len(record["load_max_over_mean"]), -1))
    return {f"expert_load/layer{i}": load_E for i, load_E in enumerate(load_LxE)}


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        self.writer = _import("tensorboard").SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        step = record["step"]
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        for tag, values in histograms(record).items():
            self.writer.add_histogram(tag, values, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """An offline run under RUN_DIR/wandb; `wandb sync` uploads it later."""

    def __init__(self, run_dir: Path, cfg: Config):
        self.wandb = _import("wandb")
        settings = self.wandb.Settings(silent=True, console="off", disable_git=True)
        self.run = self.wandb.init(project=cfg.logging.wandb_project, dir=str(run_dir),
                                   mode="offline", config=cfg.to_dict(), settings=settings)

    def log(self, record: dict) -> None:
        data = scalars(record) | {k: self.wandb.Histogram(v) for k, v in histograms(record).items()}
        self.run.log(data, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_sinks(cfg: Config, run_dir: Path) -> list:
    sinks = []
    if cfg.logging.tensorboard:
        sinks.append(TensorBoardSink(run_dir))
    if cfg.logging.wandb:
        sinks.append(WandbSink(run_dir, cfg))
    return sinks
