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
from jaxmoe.config import Config
from jaxmoe.load_metrics import load_metrics
from jaxmoe.model.transformer import Transformer
from jaxmoe.parallel.pipeline import stored_layer_order
from jaxmoe.optim import learning_rate_schedule, make_optimizer


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


def state_shardings(cfg: Config, mesh: Mesh, tx: optax.GradientTransformation,
                    abs_params: nnx.State, abs_buffers: nnx.State) -> TrainState:
    """Where each part of the state lives.

    ZeRO-1 splits optimizer state over each tensor's replica axes; with bf16
    compute the fp32 master weights are split the same way and a bf16 working
    copy is gathered inside the step.
    """
    rules = sharding.RULES[cfg.mesh.parallelism]
    param_specs = compute_param_specs(cfg, abs_params)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731

    def opt_spec(p, spec):
        return sharding.zero1_spec(spec, p.shape, mesh) if cfg.mesh.zero1 else spec

    abs_opt = jax.eval_shape(tx.init, abs_params)
    opt_specs = optax.tree_map_params(
        tx, opt_spec, abs_opt, param_specs,
        transform_non_params=lambda _: P(), is_leaf=is_spec)
    if cfg.model.compute_dtype != "float32":
        param_specs = jax.tree.map(opt_spec, abs_params, param_specs, is_leaf=is_spec)
    specs = TrainState(P(), param_specs, sharding.state_specs(abs_buffers, rules), opt_specs,
                       P(), P())
    return sharding.named(mesh, specs)


def compute_param_specs(cfg: Config, abs_params: nnx.State) -> nnx.State:
    """Where the parameters are used: the parallel mode's rules table."""
    return sharding.state_specs(abs_params, sharding.RULES[cfg.mesh.parallelism])


def working_copy(cfg: Config, mesh: Mesh, params: nnx.State, specs: nnx.State) -> nnx.State:
    """Matrices cast to the compute dtype and placed where they are used; norms and
    the router stay fp32. The identity for fp32 compute."""
    if cfg.model.compute_dtype == "float32":
        return params
    dtype = jnp.dtype(cfg.model.compute_dtype)

    def cast(path, p, spec):
        keep = p.ndim < 2 or "router" in jax.tree_util.keystr(path)
        p = p if keep else p.astype(dtype)
        return jax.lax.with_sharding_constraint(p, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(cast, params, specs,
                                            is_leaf=lambda x: isinstance(x, P))


def build_steps(cfg: Config, mesh: Mesh, loss_hook: Callable | None = None) -> Steps:
    """Compiles init, train and eval steps for `cfg` on `mesh`.

    `loss_hook(loss, step) -> loss`, for tests only, may alter the training loss
    (e.g. inject a NaN) without touching the model.
    """
    sharding.check_divisibility(cfg, mesh)
    graphdef, abs_params, abs_buffers = abstract_model(cfg)
    tx = make_optimizer(cfg.optimizer, cfg.train.steps)
    lr_at = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    shardings = state_shardings(cfg, mesh, tx, abs_params, abs_buffers)
    batch_sh = sharding.batch_sharding(mesh)
    has_moe, moe = cfg.num_moe_layers > 0, cfg.moe
    M = cfg.train.microbatches

    def init(key):
        model = Transformer(cfg, nnx.Rngs(params=key))
        _, params, buffers = nnx.split(model, nnx.Param, ...)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, buffers, tx.init(params), key, zero)

    use_specs = compute_param_specs(cfg, abs_params)

    def loss_fn(params, buffers, tokens_BxL1, key, step=None):
        model = nnx.merge(graphdef, working_copy(cfg, mesh, params, use_specs), buffers)
        x, aux = model.hidden(tokens_BxL1[:, :-1], mesh=mesh, key=key, remat=cfg.train.remat)
        ce = model.cross_entropy(x, tokens_BxL1[:, 1:], mesh, cfg.train.loss_chunk)
        loss = ce
        if loss_hook is not None and step is not None:  # training only, not eval
            loss = loss_hook(loss, step)
        if has_moe:
            loss += moe.balance_loss_weight * jnp.mean(aux["balance_loss"])
            loss += moe.z_loss_weight * jnp.mean(aux["z_loss"])
        return loss, (ce, aux)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, batch_BxL1: jax.Array):
        step_key = jax.random.fold_in(state.key, state.step)
        B, L1 = batch_BxL1.shape
        # Strided split keeps each device's rows on that device in every microbatch.
        micro_MxBxL1 = batch_BxL1.reshape(B // M, M, L1).swapaxes(0, 1)

        def micro(i, tokens):
            key = jax.random.fold_in(step_key, i) if moe.router_jitter > 0 else None
            (loss, (ce, aux)), grads = grad_fn(state.params, state.buffers, tokens, key, state.step)
            return grads, loss, ce, aux

        if M == 1:  # no accumulation loop: no zeroed gradient tree to add into
            grads, loss, ce, aux = micro(0, micro_MxBxL1[0])
        else:  # one traced copy of the model, looped
            def accumulate(sums, xs):
                return jax.tree.map(jnp.add, sums, micro(*xs)), None

            aux_shapes = jax.eval_shape(loss_fn, state.params, state.buffers, micro_MxBxL1[0],
                                        None, state.step)[1][1]  # forward only: router stats
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                 (state.params, jnp.float32(0), jnp.float32(0), aux_shapes))
            (grads, loss, ce, aux), _ = jax.lax.scan(accumulate, zeros,
                                                     (jnp.arange(M), micro_MxBxL1))
            grads = jax.tree.map(lambda g: g / M, grads)
        params, opt_state, grad_norm, finite = apply_gradients(tx, state.params, state.opt_state,
                                                               grads, loss)
        buffers = state.buffers
        # The rate this update used: the schedule runs on the optimizer's count,
        # which skipped steps do not advance.
        metrics = {"loss": loss / M, "ce": ce / M, "grad_norm": grad_norm,
                   "lr": lr_at(state.opt_state.count),
                   "skipped": (~finite).astype(jnp.int32)}
        if has_moe:
            aux = {**aux, "balance_loss": aux["balance_loss"] / M, "z_loss": aux["z_loss"] / M}
            metrics["balance_loss"] = jnp.mean(aux["balance_loss"])
            metrics["z_loss"] = jnp.mean(aux["z_loss"])
            metrics |= load_metrics(aux, B * (L1 - 1), moe.top_k, mesh.shape["expert"],
                                    moe.balance_loss_weight)
            if moe.expert_bias:
                buffers = update_expert_bias(buffers, aux["counts_E"], moe.bias_update_rate,
                                             stored_layer_order(cfg))
        buffers = jax.tree.map(lambda new, old: jnp.where(finite, new, old), buffers, state.buffers)
        bad_steps = jnp.where(finite, 0, state.bad_steps + 1)
        metrics["bad_steps"] = bad_steps
        new_state = TrainState(state.step + 1, params, buffers, opt_state, state.key, bad_steps)
        return new_state, metrics

    def eval_step(state: TrainState, batch_BxL1: jax.Array):
        _, (ce, _) = loss_fn(state.params, state.buffers, batch_BxL1, None)
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
    updates, opt_state = tx.update(grads, opt_state, params, skip=~finite, grad_norm=grad_norm)
    return optax.apply_updates(params, updates), opt_state, grad_norm, finite


def update_expert_bias(buffers: nnx.State, counts_LxE: jax.Array, rate: float,
                       order: np.ndarray | None = None) -> nnx.State:
    """Aux-loss-free balancing: nudge each expert's selection bias toward mean load.

    Uses the step's requested counts summed over the global batch (XLA reduces
    them across devices), once per optimizer step, however often a layer was
    recomputed. order: model layer of each stored slot (pipelines store layers
    by stage and may pad); counts come in model order.
    """
    counts = counts_LxE.astype(jnp.float32)
    delta = rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)
    if order is not None:  # padding slots (order >= L) get no update
        delta = jnp.concatenate([delta, jnp.zeros_like(delta[:1])])[np.minimum(order, len(delta))]

    def nudge(path, b):  # a new tree: the step's input state must stay untouched
        return b + delta if "router" in jax.tree_util.keystr(path) else b

    return jax.tree_util.tree_map_with_path(nudge, buffers)
