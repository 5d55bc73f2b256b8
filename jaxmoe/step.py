"""Sharded init, the pure train step and the eval step, compiled once per (config, mesh).

`train_step(state, batch) -> (state, metrics)` is a pure function jitted with
explicit shardings and the state donated. Randomness comes from
`fold_in(state.key, step)`. Metrics stay on device as arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmoe import sharding
from jaxmoe.config import Config, ConfigError
from jaxmoe.load_metrics import load_metrics
from jaxmoe.model.transformer import Transformer, stored_layer_order
from jaxmoe.optim import (learning_rate_schedule, make_optimizer, param_names,
                          unmatched_patterns, updates_are_elementwise)
from jaxmoe.parallel import ddp
from jaxmoe.parallel.vma import vary, varying_axes
from jaxmoe.parallel.layout import DeviceLayout, GlobalLayout
from jaxmoe.sharding import BATCH_AXES


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar
    params: nnx.State  # trained parameters (fp32 master weights)
    buffers: nnx.State  # non-trained variables: router expert biases
    opt_state: Any
    key: jax.Array  # base PRNG key; each step uses fold_in(key, step)
    bad_steps: jax.Array  # int32: consecutive steps skipped for a non-finite loss or gradient


@dataclass(frozen=True)
class Steps:
    """Compiled functions and shardings for one (config, mesh)."""

    cfg: Config
    mesh: Mesh
    graphdef: nnx.GraphDef
    state_shardings: TrainState
    batch_sharding: NamedSharding
    init: Callable[[jax.Array], TrainState]
    train_step: Callable[[TrainState, jax.Array], tuple[TrainState, dict]]
    eval_step: Callable[[TrainState, jax.Array], dict]

    def model(self, state: TrainState) -> Transformer:
        """An nnx view of the state's parameters (for notebooks and generation)."""
        return nnx.merge(self.graphdef, state.params, state.buffers)


def abstract_model(cfg: Config) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    return nnx.split(model, nnx.Param, ...)


def state_shardings(cfg: Config, layout: GlobalLayout, tx: optax.GradientTransformation,
                    abs_params: nnx.State, abs_buffers: nnx.State) -> TrainState:
    """Where each part of the state lives.

    ZeRO-1 splits optimizer state over each tensor's replica axes; with bf16
    compute the fp32 master weights are split the same way and a bf16 working
    copy is gathered inside the step.
    """
    param_specs = layout.param_specs(abs_params)
    zero1 = layout.optimizer_specs(abs_params, param_specs)
    abs_opt = jax.eval_shape(tx.init, abs_params)
    # Each copy of the parameter tree in the optimizer state is placed like the
    # parameters' ZeRO-1 shards where its tensors have the parameters' shapes; the
    # rest (step counts, an optax optimizer's factored statistics) is replicated.
    opt_specs = optax.tree_map_params(
        tx, lambda a, spec, p: spec if a.shape == p.shape else P(), abs_opt, zero1, abs_params,
        transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
    if _sharded_master(cfg):
        param_specs = zero1
    specs = TrainState(P(), param_specs, layout.buffer_specs(abs_buffers), opt_specs, P(), P())
    return sharding.named(layout.mesh, specs)


def working_copy(cfg: Config, mesh: Mesh, params: nnx.State, specs: nnx.State) -> nnx.State:
    """Matrices cast to the compute dtype and placed where they are used; norms and
    the router stay fp32. The identity for fp32 compute."""
    if cfg.model.compute_dtype == "float32":
        return params
    dtype = jnp.dtype(cfg.model.compute_dtype)

    def cast(path, p, spec):
        p = p if _stays_fp32(path, p) else p.astype(dtype)
        return jax.lax.with_sharding_constraint(p, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(cast, params, specs,
                                            is_leaf=lambda x: isinstance(x, P))


def make_loss_fn(cfg: Config, graphdef: nnx.GraphDef, layout, working: Callable) -> Callable:
    """`loss_fn(params, buffers, tokens_BxL1, key) -> (loss, (ce, aux))`: the mean
    next-token loss of the rows given, plus the router losses. `working` turns the
    parameters into the copy the model computes with."""
    has_moe, moe = cfg.num_moe_layers > 0, cfg.moe

    def loss_fn(params, buffers, tokens_BxL1, key):
        model = nnx.merge(graphdef, working(params), buffers)
        x, aux = model.hidden(tokens_BxL1[:, :-1], layout=layout, key=key, remat=cfg.train.remat)
        ce = model.cross_entropy(x, tokens_BxL1[:, 1:], layout, cfg.train.loss_chunk)
        ce = ce if layout is None else layout.ce_share(ce)
        loss = ce
        if has_moe:
            loss += moe.balance_loss_weight * jnp.mean(aux["balance_loss"])
            loss += moe.z_loss_weight * jnp.mean(aux["z_loss"])
        return loss, (ce, aux)

    return loss_fn


def accumulate_gradients(loss_fn: Callable, cfg: Config, params, buffers, batch_BxL1: jax.Array,
                         step_key: jax.Array):
    """Sums over the `train.accumulation_steps` slices of `batch_BxL1`: fp32
    gradients w.r.t. `params`, loss, ce and router stats (divide by the count)."""
    A = cfg.train.accumulation_steps
    B, L1 = batch_BxL1.shape
    # Strided split keeps each device's rows on that device in every slice.
    slices_AxBxL1 = batch_BxL1.reshape(B // A, A, L1).swapaxes(0, 1)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def one_slice(i, tokens):
        key = jax.random.fold_in(step_key, i) if cfg.moe.router_jitter > 0 else None
        (loss, (ce, aux)), grads = grad_fn(params, buffers, tokens, key)
        return jax.tree.map(lambda g: g.astype(jnp.float32), grads), loss, ce, aux

    if A == 1:  # no accumulation loop: no zeroed gradient tree to add into
        return one_slice(0, slices_AxBxL1[0])

    def add(sums, xs):  # one traced copy of the model, looped
        return jax.tree.map(jnp.add, sums, one_slice(*xs)), None

    # forward only: the shapes (and, per device, the varying axes) of loss, ce and stats
    loss, (ce, aux) = jax.eval_shape(loss_fn, params, buffers, slices_AxBxL1[0], None)
    zeros = (jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params),
             *jax.tree.map(_zeros, (loss, ce, aux)))
    sums, _ = jax.lax.scan(add, zeros, (jnp.arange(A), slices_AxBxL1))
    return sums


def _zeros(a: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of a's shape and dtype that vary over the same mesh axes as a."""
    return vary(jnp.zeros(a.shape, a.dtype), varying_axes(a))


def step_metrics(cfg: Config, layout, loss, ce, aux, grad_norm, lr, finite, num_tokens: int):
    """The step's metrics from its (global, summed over accumulation steps) losses and stats."""
    A = cfg.train.accumulation_steps
    metrics = {"loss": loss / A, "ce": ce / A, "grad_norm": grad_norm, "lr": lr,
               "skipped": (~finite).astype(jnp.int32)}
    if cfg.num_moe_layers:
        aux = {**aux, "balance_loss": aux["balance_loss"] / A, "z_loss": aux["z_loss"] / A}
        metrics["balance_loss"] = jnp.mean(aux["balance_loss"])
        metrics["z_loss"] = jnp.mean(aux["z_loss"])
        metrics |= load_metrics(aux, num_tokens, cfg.moe.top_k, layout.mesh.shape["expert"],
                                cfg.moe.balance_loss_weight)
    return metrics


def new_buffers(cfg: Config, layout, state: TrainState, aux, finite) -> nnx.State:
    """Router biases after the step (unchanged on a skipped one)."""
    buffers = state.buffers
    if cfg.num_moe_layers and cfg.moe.expert_bias:
        buffers = update_expert_bias(buffers, aux["counts_E"], cfg.moe.bias_update_rate,
                                     layout.stored_slots())
    return jax.tree.map(lambda new, old: jnp.where(finite, new, old), buffers, state.buffers)


def auto_train_step(cfg: Config, layout: GlobalLayout, loss_fn: Callable, tx, lr_at) -> Callable:
    """The train step as one auto-sharded program (fsdp, and ddp with pipeline
    stages): XLA places the reductions."""

    def train_step(state: TrainState, batch_BxL1: jax.Array):
        step_key = jax.random.fold_in(state.key, state.step)
        grads, loss, ce, aux = accumulate_gradients(loss_fn, cfg, state.params, state.buffers,
                                                    batch_BxL1, step_key)
        grads = jax.tree.map(lambda g: g / cfg.train.accumulation_steps, grads)
        params, opt_state, grad_norm, finite = apply_gradients(tx, state.params, state.opt_state,
                                                               grads, loss)
        # The rate this update used: the schedule runs on the optimizer's count,
        # which skipped steps do not advance.
        metrics = step_metrics(cfg, layout, loss, ce, aux, grad_norm, lr_at(state.opt_state.count),
                               finite, batch_BxL1.shape[0] * (batch_BxL1.shape[1] - 1))
        bad_steps = jnp.where(finite, 0, state.bad_steps + 1)
        metrics["bad_steps"] = bad_steps
        return TrainState(state.step + 1, params, new_buffers(cfg, layout, state, aux, finite),
                          opt_state, state.key, bad_steps), metrics

    return train_step


def ddp_train_step(cfg: Config, layout: DeviceLayout, specs: TrainState, use_specs: nnx.State,
                   shard_specs: nnx.State, loss_fn: Callable, tx, lr_at) -> Callable:
    """The ddp train step as one per-device program over the whole mesh.

    Each device runs the model on its own rows with its dense replicas and its
    experts; gradients accumulate locally over the accumulation steps and are reduced
    once at the end, into the ZeRO-1 shards (`jaxmoe.parallel.ddp`), where the
    optimizer updates them; the new shards are gathered once. `specs`: the state's
    PartitionSpecs; `use_specs`: where the parameters are used; `shard_specs`: where
    their optimizer state lives (`GlobalLayout.optimizer_specs`).
    """
    mesh = layout.mesh
    plans = ddp.reductions(use_specs, shard_specs, mesh)
    sharded_master = _sharded_master(cfg)
    n_batch = mesh.shape["data"] * mesh.shape["expert"]
    A = cfg.train.accumulation_steps

    def tree_map(fn, tree, plans):  # plans: a Reduction where `tree` has an array
        return jax.tree.map(fn, tree, plans)

    def local_step(state: TrainState, rows_bxL1: jax.Array):
        step_key = jax.random.fold_in(state.key, state.step)
        step_key = jax.random.fold_in(step_key, jax.lax.axis_index(BATCH_AXES))  # own jitter
        # rows, like the weights, vary over every axis (stage included), so no
        # use of a weight implies a reduction of its gradient
        rows_bxL1 = vary(rows_bxL1, ("stage",))
        # The working copy, made once per step: cast, then (ZeRO-1 bf16 masters) gathered.
        working = jax.tree_util.tree_map_with_path(
            lambda path, p: p if _stays_fp32(path, p) else p.astype(cfg.model.compute_dtype),
            state.params)
        if sharded_master:
            working = tree_map(ddp.gather_shards, working, plans)
        working = tree_map(ddp.to_per_device, working, plans)
        grads, loss, ce, aux = accumulate_gradients(loss_fn, cfg, working, state.buffers,
                                                    rows_bxL1, step_key)
        scale = 1.0 / (n_batch * A)
        grads = tree_map(lambda g, r: ddp.reduce_gradient(g, r) * scale, grads, plans)
        # over every axis: stages hold disjoint layers (zeros elsewhere) and the
        # last stage's loss (`DeviceLayout.ce_share`)
        total = lambda v: ddp.psum_everywhere(v, mesh.axis_names)  # noqa: E731
        loss, ce = total(loss) / n_batch, total(ce) / n_batch
        aux = {k: total(v) / (n_batch if k in ("balance_loss", "z_loss") else 1)
               for k, v in aux.items()}
        grad_norm = ddp.global_norm(grads, plans, mesh)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params = state.params if sharded_master else tree_map(ddp.own_shard, state.params, plans)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, state.opt_state, params, skip=~finite,
                                           grad_norm=grad_norm)
            params = optax.apply_updates(params, updates)
        if not sharded_master:
            params = tree_map(ddp.gather_shards, params, plans)
        B, L1 = rows_bxL1.shape
        metrics = step_metrics(cfg, layout, loss, ce, aux, grad_norm, lr_at(state.opt_state.count),
                               finite, n_batch * B * (L1 - 1))
        bad_steps = jnp.where(finite, 0, state.bad_steps + 1)
        metrics["bad_steps"] = bad_steps
        return TrainState(state.step + 1, params, new_buffers(cfg, layout, state, aux, finite),
                          opt_state, state.key, bad_steps), metrics

    return jax.shard_map(local_step, mesh=mesh, in_specs=(specs, P(BATCH_AXES)),
                         out_specs=(specs, P()), check_vma=True)


def _stays_fp32(path, p) -> bool:
    """Norms, biases and the router compute in fp32 whatever the compute dtype."""
    return p.ndim < 2 or "router" in jax.tree_util.keystr(path)


def _sharded_master(cfg: Config) -> bool:
    """Whether the fp32 master weights live in ZeRO-1 shards (see `state_shardings`)."""
    return cfg.mesh.zero1 and cfg.model.compute_dtype != "float32"


def uses_per_device_step(cfg: Config) -> bool:
    """ddp trains with the per-device step, pipelines included."""
    return cfg.mesh.parallelism == "ddp"


def build_steps(cfg: Config, mesh: Mesh) -> Steps:
    """Compiles init, train and eval steps for `cfg` on `mesh`."""
    layout = GlobalLayout(mesh, cfg)
    layout.check_training()
    graphdef, abs_params, abs_buffers = abstract_model(cfg)
    tx = make_optimizer(cfg.optimizer, cfg.train.steps)
    lr_at = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    shardings = state_shardings(cfg, layout, tx, abs_params, abs_buffers)
    batch_sh = layout.batch_sharding
    use_specs = layout.param_specs(abs_params)
    shard_specs = layout.optimizer_specs(abs_params, use_specs)
    check_optimizer(cfg, mesh, abs_params, shard_specs)
    global_loss = make_loss_fn(cfg, graphdef, layout,
                               lambda p: working_copy(cfg, mesh, p, use_specs))

    def init(key):
        model = Transformer(cfg, nnx.Rngs(params=key))
        _, params, buffers = nnx.split(model, nnx.Param, ...)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, buffers, tx.init(params), key, zero)

    if uses_per_device_step(cfg):
        specs = jax.tree.map(lambda s: s.spec, shardings,
                             is_leaf=lambda x: isinstance(x, NamedSharding))
        device_layout = DeviceLayout(mesh, cfg)
        local_loss = make_loss_fn(cfg, graphdef, device_layout, lambda p: p)
        train_step = ddp_train_step(cfg, device_layout, specs, use_specs, shard_specs, local_loss,
                                    tx, lr_at)
    else:
        train_step = auto_train_step(cfg, layout, global_loss, tx, lr_at)

    def eval_step(state: TrainState, batch_BxL1: jax.Array):
        _, (ce, _) = global_loss(state.params, state.buffers, batch_BxL1, None)
        return {"ce": ce}

    rep = sharding.replicated(mesh)
    return Steps(
        cfg=cfg, mesh=mesh, graphdef=graphdef, state_shardings=shardings, batch_sharding=batch_sh,
        init=jax.jit(init, in_shardings=rep, out_shardings=shardings),
        train_step=jax.jit(train_step, in_shardings=(shardings, batch_sh),
                           out_shardings=(shardings, rep), donate_argnums=0),
        eval_step=jax.jit(eval_step, in_shardings=(shardings, batch_sh), out_shardings=rep),
    )


def apply_gradients(tx: optax.GradientTransformationExtraArgs, params, opt_state, grads,
                    loss: jax.Array) -> tuple[Any, Any, jax.Array, jax.Array]:
    """The step's parameter update: (params, opt_state, grad_norm, finite).

    A non-finite loss or gradient norm changes nothing (the step counter and the
    data position still move on); the optimizer applies the skip inside its
    fused update.
    """
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    with jax.named_scope("optimizer"):
        updates, opt_state = tx.update(grads, opt_state, params, skip=~finite,
                                       grad_norm=grad_norm)
        return optax.apply_updates(params, updates), opt_state, grad_norm, finite


def check_optimizer(cfg: Config, mesh: Mesh, abs_params: nnx.State, shard_specs: nnx.State) -> None:
    """The optimizer checks that need the model's parameters and the mesh; run
    before compiling. `shard_specs`: where each parameter's optimizer state lives."""
    o = cfg.optimizer
    unmatched = unmatched_patterns(abs_params, o.no_decay)
    if unmatched:
        raise ConfigError(f"optimizer.no_decay: {unmatched} match no parameter; the "
                          f"parameters' paths are {', '.join(param_names(abs_params))}")
    # The per-device step updates each device's part of a tensor on its own: right
    # only for an optimizer that updates every element from its own history.
    specs = jax.tree.leaves(shard_specs, is_leaf=lambda x: isinstance(x, P))
    split = any(mesh.shape[a] > 1 for spec in specs for entry in spec if entry is not None
                for a in ((entry,) if isinstance(entry, str) else entry))
    if uses_per_device_step(cfg) and split and not updates_are_elementwise(o):
        raise ConfigError(f"optimizer.name: {o.name} takes statistics over whole tensors, but "
                          "the ddp step updates each device's part of a tensor (its ZeRO-1 "
                          "shard, its experts, its stage's layers) on its own; use "
                          "mesh.parallelism: fsdp, or an optimizer that updates each element "
                          "on its own (adamw, lion, sgd, ...)")


def update_expert_bias(buffers: nnx.State, counts_LxE: jax.Array, rate: float,
                       order: np.ndarray | None = None) -> nnx.State:
    """Aux-loss-free balancing: nudge each expert's selection bias toward mean load.

    Uses the step's requested counts summed over the global batch (XLA reduces
    them across devices), once per optimizer step, however often a layer was
    recomputed. order: model layer of each slot of `buffers` (pipelines store
    layers by stage and may pad); counts come in model order.
    """
    counts = counts_LxE.astype(jnp.float32)
    delta = rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)
    if order is not None:  # padding slots (order >= L) get no update
        delta = jnp.concatenate([delta, jnp.zeros_like(delta[:1])])[jnp.minimum(order, len(delta))]

    def nudge(path, b):  # a new tree: the step's input state must stay untouched
        return b + delta if "router" in jax.tree_util.keystr(path) else b

    return jax.tree_util.tree_map_with_path(nudge, buffers)


def with_weights(steps: Steps, state: TrainState, weights: dict) -> TrainState:
    """`state` with these weights: a plain dict in model order, router biases included
    (what `jaxmoe.load_params` and `jaxmoe.hf.load_hf` give), laid out as this
    config's stacks store them and placed on the mesh. The optimizer state stays."""
    order = stored_layer_order(steps.cfg)
    real = order < steps.cfg.num_moe_layers

    def stored(tree, moe):
        if isinstance(tree, dict):
            return {k: stored(v, moe or k == "moe_layers") for k, v in tree.items()}
        a = np.asarray(tree, np.float32)
        if not moe:
            return a
        out = np.zeros((len(order),) + a.shape[1:], np.float32)  # pipeline padding: zeros
        out[real] = a[order[real]]
        return out

    weights = stored(weights, False)
    params, buffers = state.params, state.buffers
    params.replace_by_pure_dict(_only(weights, params.to_pure_dict()))
    buffers.replace_by_pure_dict(_only(weights, buffers.to_pure_dict()))
    shardings = steps.state_shardings
    return state._replace(params=jax.device_put(params, shardings.params),
                          buffers=jax.device_put(buffers, shardings.buffers))


def _only(weights: dict, like: dict) -> dict:
    """The entries of `weights` that `like` has (params or buffers), shapes checked."""
    out = {}
    for k, v in like.items():
        if k not in weights:
            raise ValueError(f"weights: {k} missing")
        if isinstance(v, dict):
            out[k] = _only(weights[k], v)
        elif np.shape(weights[k]) != np.shape(v):
            raise ValueError(f"weights: {k} has shape {np.shape(weights[k])}, the model "
                             f"{np.shape(v)}")
        else:
            out[k] = weights[k]
    return out

