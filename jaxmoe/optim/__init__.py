"""The optimizers: `make_optimizer` builds the one a config names, as an optax
transformation (it composes with optax and works in anyone's own train step).

- `adamw`: jaxmoe's fused AdamW (the default), each tensor read and written once;
- `muon`: Muon for the weight matrices, that AdamW for the rest;
- `optax_bridge`: any optax optimizer by name, with the same clip and skip;
- `params`: parameter paths and the weight-decay mask; `schedules`: the learning rate;
- `qk_clip`: MuonClip's QK-clip, applied after any optimizer's update.

Every optimizer's `update(grads, state, params, skip=None, grad_norm=None)` clips the
gradients to `grad_clip` by their global norm first; with `skip` true its updates are
zero and its state is returned unchanged; `grad_norm`, the gradients' global norm when
the caller has it already, saves computing it again.
"""

from __future__ import annotations

import optax

from jaxmoe.config import OptimizerConfig
from jaxmoe.optim.adamw import make_adamw
from jaxmoe.optim.muon import make_muon
from jaxmoe.optim.optax_bridge import check_optax, optax_optimizer, with_clip_and_skip
from jaxmoe.optim.schedules import learning_rate_schedule


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformationExtraArgs:
    """`cfg.name` after a global-norm clip of `cfg.grad_clip` (0 disables), with
    decoupled weight decay on the parameters `decay_mask` selects. An optax optimizer
    that cannot run as configured is refused here, naming the key (`check_optax`),
    before anything compiles."""
    schedule = learning_rate_schedule(cfg, total_steps)
    if cfg.name == "muon":
        return make_muon(cfg, schedule)
    if cfg.name != "adamw":
        check_optax(cfg)
        return with_clip_and_skip(optax_optimizer(cfg, schedule), cfg.grad_clip)
    return make_adamw(cfg, schedule)
