"""The optimizer: jaxmoe's fused AdamW or any optax optimizer by name, each after a
global-norm clip and with a real skip; the weight-decay mask; the schedules.

`make_optimizer` returns an optax transformation, so it composes with optax and
works in anyone's own train step. The default, `name: adamw`, gives the numbers
of chaining optax's `clip_by_global_norm`, `scale_by_adam`, `add_decayed_weights`
and `scale_by_learning_rate`, computed so that a train step reads and writes
each tensor once:

- Each tensor's new moments and update come from one elementwise expression, so
  XLA makes one pass per output over the parameter, gradient and moments. A
  chained optimizer followed by a `where` that keeps the old state on a skipped
  step makes XLA recompute the moments inside the parameter update and copy both
  donated moment buffers first: twice the optimizer's memory traffic, which for
  a many-expert model is a large share of the step (benchmarks/RESULTS.md).
- `skip` (a traced bool) makes the step a no-op inside those same expressions:
  moments, count and parameters stay as they were.

`name: muon` is Muon for the weight matrices and this AdamW for the rest
(`jaxmoe.muon`). Any other name is an optax optimizer wrapped to keep the same
contract (the skip becomes a `where` over its state, at that extra memory traffic).

Weight decay is masked by parameter path: `decay_mask`.
"""

from __future__ import annotations

import fnmatch
import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmoe.config import ConfigError, OptimizerConfig
from jaxmoe.muon import on_one_device, orthogonalized, rms_scale, view_of


class AdamWState(NamedTuple):
    count: jax.Array  # int32: optimizer steps taken (skipped steps not counted)
    mu: Any  # first moments, shaped like the parameters, in `mu_dtype`
    nu: Any  # second moments


class OptaxState(NamedTuple):
    count: jax.Array  # int32: optimizer steps taken (skipped steps not counted)
    inner: Any  # the optax optimizer's own state


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


# ---------------------------------------------------------------- weight-decay mask


def param_name(path) -> str:
    """A parameter's path joined with "/", e.g. "moe_layers/moe/router/w" (an nnx
    Variable's trailing `.value` left out)."""
    parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
        parts = parts[:-1]
    return "/".join(parts)


def _is_norm_or_bias(name: str, p) -> bool:
    """Vectors, and what the name says is a norm or a bias: stacked layers give a
    norm's scale a leading layer axis, so the rank alone would call it a matrix."""
    parts = name.lower().split("/")
    return (p.ndim < 2 or any("norm" in part for part in parts)
            or parts[-1].endswith(("bias", "scale")))


def decays(name: str, p, no_decay: tuple[str, ...]) -> bool:
    """Whether weight decay applies to the parameter `p` at path `name`."""
    return not (_is_norm_or_bias(name, p) or any(fnmatch.fnmatchcase(name, pattern)
                                                 for pattern in no_decay))


def decay_mask(params, no_decay: tuple[str, ...]):
    """A tree like `params` holding, for each parameter, whether it decays. Static:
    it depends on paths and ranks only."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: decays(param_name(path), p, no_decay), params)


def param_names(params) -> list[str]:
    return [param_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]


def unmatched_patterns(params, no_decay: tuple[str, ...]) -> list[str]:
    """The `no_decay` patterns that match no parameter of `params` (typos)."""
    names = param_names(params)
    return [pattern for pattern in no_decay
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names)]


# ---------------------------------------------------------------- the optimizer


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformationExtraArgs:
    """`cfg.name` after a global-norm clip of `cfg.grad_clip` (0 disables), with
    decoupled weight decay on the parameters `decay_mask` selects.

    An optax optimizer that cannot run as configured is refused here, naming the key
    (`check_optax`), before anything compiles.

    `update(grads, state, params, skip=None, grad_norm=None)`: with `skip` true the
    returned updates are zero and the state is returned unchanged; `grad_norm`, the
    gradients' global norm when the caller has it already, saves computing it again.
    """
    schedule = learning_rate_schedule(cfg, total_steps)
    if cfg.name == "muon":
        return make_muon(cfg, schedule)
    if cfg.name != "adamw":
        check_optax(cfg)
        return _with_clip_and_skip(optax_optimizer(cfg, schedule), cfg.grad_clip)
    b1, b2, eps, wd = cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay
    mu_dtype = jnp.dtype(cfg.mu_dtype)

    def init(params):
        return AdamWState(jnp.zeros([], jnp.int32),
                          jax.tree.map(lambda p: jnp.zeros_like(p, mu_dtype), params),
                          jax.tree.map(jnp.zeros_like, params))

    def update(grads, state: AdamWState, params=None, *, skip=None, grad_norm=None, **_):
        if params is None:
            raise ValueError("make_optimizer's AdamW needs params (for weight decay)")
        s = _StepTerms.of(cfg, schedule, grads, state.count, skip, grad_norm)
        mu = jax.tree.map(lambda g, m: _ema(g * s.scale.astype(g.dtype), m, s.take, b1),
                          grads, state.mu)
        nu = jax.tree.map(lambda g, v: _ema(jnp.square(g * s.scale.astype(g.dtype)), v, s.take,
                                            b2), grads, state.nu)

        def step(p, m, v, decay):
            u = _adam_direction(m, v, s, eps)
            if decay:
                u = u + wd * p
            return (-s.rate * u).astype(p.dtype)

        updates = jax.tree.map(step, params, mu, nu, decay_mask(params, cfg.no_decay))
        return updates, AdamWState(s.count, jax.tree.map(lambda m: m.astype(mu_dtype), mu), nu)

    return optax.GradientTransformationExtraArgs(init, update)


class _StepTerms(NamedTuple):
    """What every tensor's update of one step shares (jaxmoe's AdamW and Muon)."""

    take: jax.Array  # not a skipped step
    scale: jax.Array  # the global-norm clip's factor
    count: jax.Array  # the optimizer's step count after this step
    rate: jax.Array  # the learning rate, 0 on a skipped step
    t: jax.Array  # the count for bias corrections (1 when skipping keeps it at 0)
    c1: jax.Array  # Adam's bias corrections at t
    c2: jax.Array

    @classmethod
    def of(cls, cfg: OptimizerConfig, schedule, grads, count, skip, grad_norm) -> _StepTerms:
        take = jnp.bool_(True) if skip is None else ~jnp.asarray(skip, bool)
        new = count + take.astype(jnp.int32)
        # A skipped step keeps the moments, so u is finite (made from the last finite
        # moments) and a rate of zero makes the update exactly zero. A select against a
        # zero constant here would share that constant with the gradient accumulator's
        # zeros (XLA's CSE), and XLA then keeps a materialised parameter-size zero
        # buffer alive across the whole step for it (22.55 GB on the 47B config).
        rate = schedule(count) * take.astype(jnp.float32)
        t = jnp.maximum(new, 1).astype(jnp.float32)
        return cls(take, _clip_scale(grads, cfg.grad_clip, grad_norm), new, rate, t,
                   1 - cfg.b1 ** t, 1 - cfg.b2 ** t)


def _ema(x, m, take, decay: float) -> jax.Array:
    """A moment after x, in float32 whatever its stored dtype (rounded once, on
    storing); a skipped step keeps it."""
    m = m.astype(jnp.float32)
    return jnp.where(take, decay * m + (1 - decay) * x, m)


def _adam_direction(m, v, s: _StepTerms, eps: float) -> jax.Array:
    return (m / s.c1) / (jnp.sqrt(v / s.c2) + eps)


# ---------------------------------------------------------------- Muon


class MuonState(NamedTuple):
    count: jax.Array  # int32: optimizer steps taken (skipped steps not counted)
    mu: Any  # Muon's momentum for its matrices, Adam's first moment for the rest (mu_dtype)
    nu: Any  # Adam's second moment; a scalar zero for Muon's matrices


def assignment(params, adamw_params: tuple[str, ...] = ()) -> dict[str, str]:
    """Each parameter's optimizer, "muon" or "adamw", by path (printed at start)."""
    return {param_name(path): "muon" if view_of(param_name(path), p, adamw_params) else "adamw"
            for path, p in jax.tree_util.tree_leaves_with_path(params)}


def describe(params, adamw_params: tuple[str, ...] = ()) -> str:
    """One line: which parameters each optimizer updates (printed at a run's start)."""
    got = assignment(params, adamw_params)
    names = {o: sorted(n for n, who in got.items() if who == o) for o in ("muon", "adamw")}
    return "; ".join(f"{o} updates {len(n)}: {', '.join(n)}" for o, n in names.items())


def make_muon(cfg: OptimizerConfig, schedule: optax.Schedule
              ) -> optax.GradientTransformationExtraArgs:
    """Muon + AdamW with `make_optimizer`'s contract (clip, skip, grad_norm), and
    `whole_matrices` (see the module doc) as an update argument."""
    beta, steps, rms = cfg.muon_momentum, cfg.muon_ns_steps, cfg.muon_rms
    ns_dtype = jnp.dtype(cfg.muon_ns_dtype)
    b1, b2, eps, wd = cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay
    mu_dtype = jnp.dtype(cfg.mu_dtype)

    def init(params):
        named = jax.tree_util.tree_leaves_with_path(params)
        vs = [view_of(param_name(path), p, cfg.adamw_params) for path, p in named]
        leaves, tree = jax.tree.flatten(params)
        mu = [jnp.zeros_like(p, mu_dtype) for p in leaves]
        nu = [jnp.zeros((), jnp.float32) if v else jnp.zeros_like(p)
              for p, v in zip(leaves, vs)]
        return MuonState(jnp.zeros([], jnp.int32), tree.unflatten(mu), tree.unflatten(nu))

    def update(grads, state: MuonState, params=None, *, skip=None, grad_norm=None,
               whole_matrices: Callable = on_one_device, **_):
        if params is None:
            raise ValueError("Muon needs params (for weight decay)")
        s = _StepTerms.of(cfg, schedule, grads, state.count, skip, grad_norm)
        t = s.t
        named = jax.tree_util.tree_leaves_with_path(params)
        names = [param_name(path) for path, _ in named]
        leaves = [p for _, p in named]
        tree = jax.tree.structure(params)
        g_, m_, v_ = (tree.flatten_up_to(x) for x in (grads, state.mu, state.nu))
        decay = tree.flatten_up_to(decay_mask(params, cfg.no_decay))
        out_u, out_m, out_v = [], [], []
        for name, p, g, m, v, d in zip(names, leaves, g_, m_, v_, decay):
            g = g * s.scale.astype(g.dtype)
            view = view_of(name, p, cfg.adamw_params)
            if view is None:  # AdamW, as `make_optimizer`'s
                m_new, v_new = _ema(g, m, s.take, b1), _ema(jnp.square(g), v, s.take, b2)
                u = _adam_direction(m_new, v_new, s, eps)
                out_m.append(m_new.astype(mu_dtype))
                out_v.append(v_new)
            else:
                m_new = _ema(g, m, s.take, beta)
                # Nesterov, bias-corrected as optax's scale_by_muon
                nesterov = (beta * m_new / (1 - beta ** (t + 1))
                            + (1 - beta) * g / (1 - beta ** t))
                # scaled where the matrices are whole: their fan sizes are the full ones
                u = whole_matrices(name, nesterov, view, lambda x, view=view: rms_scale(
                    x.shape, view, rms) * orthogonalized(x, view, steps, ns_dtype))
                out_m.append(m_new.astype(mu_dtype))
                out_v.append(v)
            if d:
                u = u + wd * p
            out_u.append((-s.rate * u).astype(p.dtype))
        return tree.unflatten(out_u), MuonState(s.count, tree.unflatten(out_m),
                                                tree.unflatten(out_v))

    return optax.GradientTransformationExtraArgs(init, update)


def _clip_scale(grads, clip: float, grad_norm) -> jax.Array:
    """The factor that brings the gradients' global norm down to `clip` (0: none)."""
    if clip <= 0:
        return jnp.float32(1)
    norm = optax.tree.norm(grads) if grad_norm is None else grad_norm
    return clip / jnp.maximum(norm, clip)


def _with_clip_and_skip(inner: optax.GradientTransformation,
                        clip: float) -> optax.GradientTransformationExtraArgs:
    """`inner` after the global-norm clip, with `make_optimizer`'s update contract."""

    def init(params):
        return OptaxState(jnp.zeros([], jnp.int32), inner.init(params))

    def update(grads, state: OptaxState, params=None, *, skip=None, grad_norm=None, **extra):
        scale = _clip_scale(grads, clip, grad_norm)
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


# ---------------------------------------------------------------- optax by name

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
