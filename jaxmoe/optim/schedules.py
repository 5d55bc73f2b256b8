"""The learning-rate schedules: linear warmup, then cosine, wsd (stable, then a linear
decay over the last `decay_fraction` of the steps) or constant."""

from __future__ import annotations

import optax

from jaxmoe.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warm = optax.linear_schedule(0.0, peak, max(cfg.warmup_steps, 1))
    rest = total_steps - cfg.warmup_steps
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, max(rest, 1), alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "wsd":
        # a decay longer than the post-warmup run starts at warmup's end
        decay = min(max(int(round(total_steps * cfg.decay_fraction)), 1), max(rest, 1))
        after = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
            [max(rest - decay, 0)])
    else:
        after = optax.constant_schedule(peak)
    return optax.join_schedules([warm, after], [cfg.warmup_steps])
