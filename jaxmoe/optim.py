"""AdamW with global-norm clipping, fused into one pass per tensor, and its schedules.

`make_optimizer` returns an optax transformation, so it composes with optax and
works in anyone's own train step. Its update differs from chaining optax's
`clip_by_global_norm`, `scale_by_adam`, `add_decayed_weights` and
`scale_by_learning_rate` in two ways that matter at scale:

- Each tensor's new moments and update come from one elementwise expression, so
  XLA makes one pass per output over the parameter, gradient and moments. The
  chained form, followed by a `where` that keeps the old state on a skipped step,
  made XLA recompute the moments inside the parameter update and copy both
  donated moment buffers first: twice the optimizer's memory traffic, which for
  a many-expert model is a large share of the step (benchmarks/RESULTS.md).
- `skip` (a traced bool) makes the step a no-op inside those same expressions:
  moments, count and parameters stay as they were.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmoe.config import OptimizerConfig


class AdamWState(NamedTuple):
    count: jax.Array  # int32: optimizer steps taken (skipped steps not counted)
    mu: Any  # first moments, shaped like the parameters
    nu: Any  # second moments


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


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformationExtraArgs:
    """AdamW (decoupled weight decay on matrices only, not norms or biases) after a
    global-norm clip of `cfg.grad_clip` (0 disables).

    `update(grads, state, params, skip=None, grad_norm=None)`: with `skip` true the
    returned updates are zero and the state is returned unchanged; `grad_norm`, the
    gradients' global norm when the caller has it already, saves computing it again.
    """
    schedule = learning_rate_schedule(cfg, total_steps)
    b1, b2, eps, wd, clip = cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay, cfg.grad_clip

    def init(params):
        zeros = lambda p: jnp.zeros_like(p)  # noqa: E731
        return AdamWState(jnp.zeros([], jnp.int32), jax.tree.map(zeros, params),
                          jax.tree.map(zeros, params))

    def update(grads, state: AdamWState, params=None, *, skip=None, grad_norm=None, **_):
        if params is None:
            raise ValueError("make_optimizer's AdamW needs params (for weight decay)")
        take = jnp.bool_(True) if skip is None else ~jnp.asarray(skip, bool)
        if clip > 0:
            norm = optax.tree.norm(grads) if grad_norm is None else grad_norm
            scale = clip / jnp.maximum(norm, clip)
        else:
            scale = jnp.float32(1)
        count = state.count + take.astype(jnp.int32)
        lr = schedule(state.count)
        # Bias corrections at the new count (1 when skipping keeps count at 0).
        t = jnp.maximum(count, 1).astype(jnp.float32)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t

        def first(g, m):
            return jnp.where(take, b1 * m + (1 - b1) * (g * scale.astype(g.dtype)), m)

        def second(g, v):
            g = g * scale.astype(g.dtype)
            return jnp.where(take, b2 * v + (1 - b2) * (g * g), v)

        mu = jax.tree.map(first, grads, state.mu)
        nu = jax.tree.map(second, grads, state.nu)

        def step(p, m, v):
            u = (m / c1) / (jnp.sqrt(v / c2) + eps)
            if p.ndim >= 2:
                u = u + wd * p
            return jnp.where(take, -lr * u, 0).astype(p.dtype)

        return jax.tree.map(step, params, mu, nu), AdamWState(count, mu, nu)

    return optax.GradientTransformationExtraArgs(init, update)
