"""jaxmoe's fused AdamW, and the terms every tensor's update of a step shares (AdamW's and
Muon's).

The default optimizer, `name: adamw`, gives the numbers of chaining optax's
`clip_by_global_norm`, `scale_by_adam`, `add_decayed_weights` and
`scale_by_learning_rate`, computed so that a train step reads and writes each tensor
once:

- Each tensor's new moments and update come from one elementwise expression, so
  XLA makes one pass per output over the parameter, gradient and moments. A
  chained optimizer followed by a `where` that keeps the old state on a skipped
  step makes XLA recompute the moments inside the parameter update and copy both
  donated moment buffers first: twice the optimizer's memory traffic, which for
  a many-expert model is a large share of the step (benchmarks/RESULTS.md).
- `skip` (a traced bool) makes the step a no-op inside those same expressions:
  moments, count and parameters stay as they were.

`name: muon` is Muon for the weight matrices and this AdamW for the rest
(`jaxmoe.optim.muon`). Any other name is an optax optimizer wrapped to keep the same
contract (`jaxmoe.optim.optax_bridge`: the skip becomes a `where` over its state, at
that extra memory traffic). Weight decay is masked by parameter path
(`jaxmoe.optim.params.decay_mask`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmoe.config import OptimizerConfig
from jaxmoe.optim.params import decay_mask


class AdamWState(NamedTuple):
    count: jax.Array  # int32: optimizer steps taken (skipped steps not counted)
    mu: Any  # first moments, shaped like the parameters, in `mu_dtype`
    nu: Any  # second moments


def make_adamw(cfg: OptimizerConfig, schedule: optax.Schedule
               ) -> optax.GradientTransformationExtraArgs:
    """jaxmoe's fused AdamW with `make_optimizer`'s contract (`jaxmoe.optim`'s doc)."""
    b1, b2, eps, wd = cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay
    mu_dtype = jnp.dtype(cfg.mu_dtype)

    def init(params):
        return AdamWState(jnp.zeros([], jnp.int32),
                          jax.tree.map(lambda p: jnp.zeros_like(p, mu_dtype), params),
                          jax.tree.map(jnp.zeros_like, params))

    def update(grads, state: AdamWState, params=None, *, skip=None, grad_norm=None, **_):
        if params is None:
            raise ValueError("AdamW needs params (for weight decay)")
        s = StepTerms.of(cfg, schedule, grads, state.count, skip, grad_norm)
        mu = jax.tree.map(lambda g, m: ema(g * s.scale.astype(g.dtype), m, s.take, b1),
                          grads, state.mu)
        nu = jax.tree.map(lambda g, v: ema(jnp.square(g * s.scale.astype(g.dtype)), v, s.take,
                                            b2), grads, state.nu)

        def step(p, m, v, decay):
            u = adam_direction(m, v, s, eps)
            if decay:
                u = u + wd * p
            return (-s.rate * u).astype(p.dtype)

        updates = jax.tree.map(step, params, mu, nu, decay_mask(params, cfg.no_decay))
        return updates, AdamWState(s.count, jax.tree.map(lambda m: m.astype(mu_dtype), mu), nu)

    return optax.GradientTransformationExtraArgs(init, update)


class StepTerms(NamedTuple):
    """What every tensor's update of one step shares (jaxmoe's AdamW and Muon)."""

    take: jax.Array  # not a skipped step
    scale: jax.Array  # the global-norm clip's factor
    count: jax.Array  # the optimizer's step count after this step
    rate: jax.Array  # the learning rate, 0 on a skipped step
    t: jax.Array  # the count for bias corrections (1 when skipping keeps it at 0)
    c1: jax.Array  # Adam's bias corrections at t
    c2: jax.Array

    @classmethod
    def of(cls, cfg: OptimizerConfig, schedule, grads, count, skip, grad_norm) -> StepTerms:
        take = jnp.bool_(True) if skip is None else ~jnp.asarray(skip, bool)
        new = count + take.astype(jnp.int32)
        # A skipped step keeps the moments, so u is finite (made from the last finite
        # moments) and a rate of zero makes the update exactly zero. A select against a
        # zero constant here would share that constant with the gradient accumulator's
        # zeros (XLA's CSE), and XLA then keeps a materialised parameter-size zero
        # buffer alive across the whole step for it (22.55 GB on the 47B config).
        rate = schedule(count) * take.astype(jnp.float32)
        t = jnp.maximum(new, 1).astype(jnp.float32)
        return cls(take, clip_scale(grads, cfg.grad_clip, grad_norm), new, rate, t,
                   1 - cfg.b1 ** t, 1 - cfg.b2 ** t)


def ema(x, m, take, decay: float) -> jax.Array:
    """A moment after x, in float32 whatever its stored dtype (rounded once, on
    storing); a skipped step keeps it."""
    m = m.astype(jnp.float32)
    return jnp.where(take, decay * m + (1 - decay) * x, m)


def adam_direction(m, v, s: StepTerms, eps: float) -> jax.Array:
    return (m / s.c1) / (jnp.sqrt(v / s.c2) + eps)


def clip_scale(grads, clip: float, grad_norm) -> jax.Array:
    """The factor that brings the gradients' global norm down to `clip` (0: none)."""
    if clip <= 0:
        return jnp.float32(1)
    norm = optax.tree.norm(grads) if grad_norm is None else grad_norm
    return clip / jnp.maximum(norm, clip)
