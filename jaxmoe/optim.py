"""AdamW with warmup and a cosine or warmup-stable-decay schedule, plus clipping."""

from __future__ import annotations

import jax
import optax

from jaxmoe.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warm = optax.linear_schedule(0.0, peak, max(cfg.warmup_steps, 1))
    rest = total_steps - cfg.warmup_steps
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, max(rest, 1), alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "wsd":
        decay = max(int(round(total_steps * cfg.decay_fraction)), 1)
        after = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
            [max(rest - decay, 0)])
    else:
        after = optax.constant_schedule(peak)
    return optax.join_schedules([warm, after], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """Weight decay applies to matrices only (not norms, biases or scalars)."""
    adamw = optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2,
                        eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw
