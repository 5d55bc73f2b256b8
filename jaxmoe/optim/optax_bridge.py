"""Any optax optimizer by name (`optimizer.name: lion`, `optax.adamw`, ...), called with
jaxmoe's schedule, weight decay and mask, and wrapped in its clip and skip; and the test
of whether an optimizer may update a split tensor part by part (the ddp step does)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmoe.config import ConfigError, OptimizerConfig
from jaxmoe.optim.adamw import clip_scale
from jaxmoe.optim.params import decay_mask


class OptaxState(NamedTuple):
    count: jax.Array  # int32: optimizer steps taken (skipped steps not counted)
    inner: Any  # the optax optimizer's own state


def with_clip_and_skip(inner: optax.GradientTransformation,
                        clip: float) -> optax.GradientTransformationExtraArgs:
    """`inner` after the global-norm clip, with `make_optimizer`'s update contract."""

    def init(params):
        return OptaxState(jnp.zeros([], jnp.int32), inner.init(params))

    def update(grads, state: OptaxState, params=None, *, skip=None, grad_norm=None, **extra):
        scale = clip_scale(grads, clip, grad_norm)
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        updates, new_inner = inner.update(grads, state.inner, params, **extra)
        if skip is None:
            return updates, OptaxState(state.count + 1, new_inner)
        take = ~jnp.asarray(skip, bool)
        updates = jax.tree.map(lambda u: jnp.where(take, u, jnp.zeros_like(u)), updates)
        new_inner = jax.tree.map(lambda new, old: jnp.where(take, new, old), new_inner,
                                 state.inner)
        return updates, OptaxState(state.count + take.astype(jnp.int32), new_inner)

    return optax.GradientTransformationExtraArgs(init, update)


# Arguments jaxmoe fills from its own keys, where the optax function takes them.
_SET_BY = {"learning_rate": "learning_rate", "weight_decay": "weight_decay",
           "weight_decay_rate": "weight_decay", "mask": "no_decay",
           "weight_decay_mask": "no_decay", "mu_dtype": "mu_dtype"}


def optax_function(name: str) -> Callable[..., optax.GradientTransformation]:
    """The optax optimizer `name` ("lion" or "optax.lion") names: a function of
    optax taking a `learning_rate`; raises ConfigError otherwise."""
    bare = name.removeprefix("optax.")
    fn = getattr(optax, bare, None) if bare.isidentifier() and not bare.startswith("_") else None
    # functions and partials of them (nadamw is adamw with nesterov=True); not classes
    if (not callable(fn) or inspect.isclass(fn)
            or "learning_rate" not in inspect.signature(fn).parameters):
        raise ConfigError(f"optimizer.name: {name!r} is neither 'adamw' (jaxmoe's) nor an optax "
                          "optimizer (a function of optax taking a learning_rate, e.g. lion, "
                          "adafactor, sgd, optax.adamw)")
    return fn


def _optax_arguments(cfg: OptimizerConfig, fn: Callable, learning_rate) -> dict[str, Any]:
    """The keyword arguments jaxmoe calls `fn` with; raises ConfigError naming the key
    where the config asks for something `fn` cannot do."""
    label = f"optax.{cfg.name.removeprefix('optax.')}"
    takes = inspect.signature(fn).parameters
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in takes.values())
    for k in cfg.optax_kwargs:
        if k in _SET_BY:
            raise ConfigError(f"optimizer.optax_kwargs.{k}: set through "
                              f"optimizer.{_SET_BY[k]}")
        if k not in takes and not any_keyword:
            raise ConfigError(f"optimizer.optax_kwargs.{k}: {label} takes no argument {k!r} "
                              f"(it takes {', '.join(n for n in takes if n not in _SET_BY)})")
    args = {"learning_rate": learning_rate, **cfg.optax_kwargs}
    decay_arg = next((n for n in ("weight_decay", "weight_decay_rate") if n in takes), None)
    mask_arg = next((n for n in ("mask", "weight_decay_mask") if n in takes), None)
    if cfg.weight_decay > 0:
        if decay_arg is None:
            raise ConfigError(f"optimizer.weight_decay: {label} has no weight decay; set "
                              "optimizer.weight_decay: 0")
        if mask_arg is None:
            raise ConfigError(f"optimizer.weight_decay: {label}'s weight decay takes no mask, "
                              "so it would decay norms, biases and optimizer.no_decay too; set "
                              "optimizer.weight_decay: 0")
    if decay_arg is not None:
        args[decay_arg] = cfg.weight_decay
    if mask_arg is not None:
        args[mask_arg] = lambda params: decay_mask(params, cfg.no_decay)
    if "mu_dtype" in takes:
        args["mu_dtype"] = jnp.dtype(cfg.mu_dtype)
    elif cfg.mu_dtype != "float32":
        raise ConfigError(f"optimizer.mu_dtype: {label} takes no mu_dtype (the dtype of a first "
                          "moment)")
    return args


def optax_optimizer(cfg: OptimizerConfig, learning_rate) -> optax.GradientTransformation:
    """The optax optimizer `cfg.name`, called with `learning_rate` (a schedule or a
    number) and the config's arguments: without the clip and the skip."""
    fn = optax_function(cfg.name)
    return fn(**_optax_arguments(cfg, fn, learning_rate))


def check_optax(cfg: OptimizerConfig) -> None:
    """Raises ConfigError naming the key if `cfg` names an optax optimizer that cannot
    be built or updated as configured: an unknown name or argument, a bad argument
    value, one that needs more than gradients, state and parameters to update. Only
    traces the update, on a two-tensor tree."""
    tx = optax_optimizer(cfg, 1e-3)
    tree = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32),
            "norm": jax.ShapeDtypeStruct((4,), jnp.float32)}
    try:
        jax.eval_shape(lambda p: tx.update(p, tx.init(p), p), tree)
    except Exception as e:  # whatever optax raises: the configured optimizer cannot run
        key = "optimizer.optax_kwargs" if cfg.optax_kwargs else "optimizer.name"
        detail = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"{key}: optax.{cfg.name.removeprefix('optax.')} with "
                          f"{cfg.optax_kwargs} fails a test update: {type(e).__name__}: "
                          f"{detail}") from None


def updates_are_elementwise(cfg: OptimizerConfig) -> bool:
    """Whether the optimizer updates each element from that element's own history
    alone, so that updating the parts of a split tensor separately (what the ddp
    step does with each device's ZeRO-1 shard) equals updating it whole. Adam-like
    optimizers are; ones with per-tensor statistics (lamb, lars, adafactor's factored
    moments and parameter scale) are not. Measured: two steps on a 128 x 256 tensor
    (adafactor factors tensors from 128 on), whole and in two halves."""
    if cfg.name == "adamw":
        return True
    if cfg.name == "muon":  # whole matrices: the ddp step gathers them (`whole_matrices`)
        return False
    tx = optax_optimizer(cfg, 1e-2)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k1, (128, 256))
    grads = [jax.random.normal(k, (128, 256)) for k in (k2, k3)]

    def run(tree):
        p = tree(w)
        state = tx.init(p)
        for g in grads:
            u, state = tx.update(tree(g), state, p)
            p = optax.apply_updates(p, u)
        return jnp.concatenate(list(p.values()), axis=1)

    whole, halves = jax.jit(lambda: (run(lambda x: {"a": x}),
                                     run(lambda x: {"a": x[:, :128], "b": x[:, 128:]})))()
    # elementwise: the same operations on the same numbers, up to fusion order
    return bool(jnp.allclose(whole, halves, rtol=1e-5, atol=1e-6))
