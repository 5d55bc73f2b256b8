"""The train state, and the steps compiled once per (config, mesh).

`train_step(state, batch) -> (state, metrics)` is a pure function jitted with
explicit shardings and the state donated. Randomness comes from
`fold_in(state.key, step)`. Metrics stay on device as arrays. The scoring steps
run the model forward through the same program as training: `eval_step` at the
training capacity (the held-out loss), `score_step` dropless (downstream tasks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmoe.config import Config, dropless
from jaxmoe.model.attention import MAX_LOGIT
from jaxmoe.model.router import update_expert_bias
from jaxmoe.model.transformer import Transformer
from jaxmoe.optim import make_optimizer, qk_clip
from jaxmoe.optim.schedules import learning_rate_schedule
from jaxmoe.parallel import sharding
from jaxmoe.parallel.sharding import BATCH_AXES
from jaxmoe.step.checks import check_mesh, uses_per_device_step
from jaxmoe.step.loss import (accumulate_gradients, make_loss_fn, make_score_fn,
                              overflowed_buffers, step_metrics, tokens_after, with_tokens_after)
from jaxmoe.step.pipelined import pipelined_gradients
from jaxmoe.step.program import AutoProgram, DeviceProgram, Program, sharded_master


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar
    params: nnx.State  # trained parameters (fp32 master weights), as the layout stores them
    buffers: nnx.State  # non-trained variables: router expert biases
    opt_state: Any
    key: jax.Array  # base PRNG key; each step uses fold_in(key, step)
    bad_steps: jax.Array  # int32: consecutive steps skipped for a non-finite loss or gradient


@dataclass(frozen=True)
class Steps:
    """Compiled functions and shardings for one (config, mesh)."""

    cfg: Config
    mesh: Mesh
    program: Program  # where the state lives (MoE stacks by pipeline stage) and the step runs
    graphdef: nnx.GraphDef
    state_shardings: TrainState
    batch_sharding: NamedSharding
    init: Callable[[jax.Array], TrainState]
    train_step: Callable[[TrainState, jax.Array], tuple[TrainState, dict]]
    # (params, buffers, tokens_BxL1, mask_BxL) -> {"logprob": [B], "greedy": [B]}: each
    # row's summed log-probability of its masked targets, and 1.0 where every one of
    # them is the model's argmax; eval_step at the training capacity, score_step dropless
    eval_step: Callable[[nnx.State, nnx.State, jax.Array, jax.Array], dict]
    score_step: Callable[[nnx.State, nnx.State, jax.Array, jax.Array], dict]

    def model(self, state: TrainState) -> Transformer:
        """An nnx view of the state's parameters, MoE layers in model order (for
        notebooks and generation)."""
        return nnx.merge(self.graphdef, self.program.in_model_order(state.params),
                         self.program.in_model_order(state.buffers))


def abstract_model(cfg: Config) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, params, buffers) of the model, abstract: the same for every mesh."""
    model = nnx.eval_shape(lambda: Transformer.of(cfg, nnx.Rngs(0)))
    return nnx.split(model, nnx.Param, ...)


def state_shardings(cfg: Config, program: Program, tx: optax.GradientTransformation,
                    abs_params: nnx.State, abs_buffers: nnx.State) -> TrainState:
    """Where each part of the state lives (`abs_params`, `abs_buffers`: the model's).

    ZeRO-1 splits optimizer state over each tensor's replica axes; with bf16
    compute the fp32 master weights are split the same way and a bf16 working
    copy is gathered inside the step.
    """
    stored = jax.eval_shape(program.stored, abs_params)
    param_specs, zero1 = program.use_specs, program.shard_specs
    abs_opt = jax.eval_shape(tx.init, stored)
    # Each copy of the parameter tree in the optimizer state is placed like the
    # parameters' ZeRO-1 shards where its tensors have the parameters' shapes; the
    # rest (step counts, an optax optimizer's factored statistics) is replicated.
    opt_specs = optax.tree_map_params(
        tx, lambda a, spec, p: spec if a.shape == p.shape else P(), abs_opt, zero1, stored,
        transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
    if sharded_master(cfg):
        param_specs = zero1
    specs = TrainState(P(), param_specs, program.buffer_specs(abs_buffers), opt_specs, P(), P())
    return sharding.named(program.mesh, specs)


def new_buffers(cfg: Config, program: Program, state: TrainState, aux, finite) -> nnx.State:
    """Router biases after the step (unchanged on a skipped one)."""
    buffers = state.buffers
    if cfg.num_moe_layers and cfg.moe.expert_bias:
        buffers = update_expert_bias(buffers, aux["counts"], cfg.moe.bias_update_rate,
                                     program.own_layers, cfg.model.mtp_layers)
    return jax.tree.map(lambda new, old: jnp.where(finite, new, old), buffers, state.buffers)


def make_train_step(cfg: Config, program, gradients: Callable, tx, lr_at) -> Callable:
    """The one train step body, for either program. gradients(working, buffers, rows,
    key) -> (grads, loss, ce, aux): `accumulate_gradients`' sums."""

    def train_step(state: TrainState, batch_BxL1: jax.Array):
        extra = tokens_after(cfg)
        step_key, rows = program.start(jax.random.fold_in(state.key, state.step),
                                       with_tokens_after(cfg, batch_BxL1), extra)
        with jax.named_scope("working_copy"):
            working = program.working(state.params)
        grads, loss, ce, aux = gradients(working, state.buffers, rows, step_key)
        with jax.named_scope("reduce"):
            grads = program.reduce(grads)
        loss, ce, aux = program.totals(loss, ce, aux)
        grad_norm = program.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # a step to be run again at larger capacity (`jaxmoe.step.overflow`) changes nothing,
        # its step count included, so the rerun draws the same keys
        overflowed = overflowed_buffers(cfg, aux)
        apply = finite & ~overflowed
        # Muon's matrices, whole wherever the program splits them
        whole = {"whole_matrices": program.whole_matrices} if cfg.optimizer.name == "muon" else {}
        params, opt_state = _update(tx, program.own(state.params), state.opt_state, grads,
                                    grad_norm, apply, **whole)
        if cfg.optimizer.qk_clip:
            params = qk_clip.rescaled(cfg, params, aux[MAX_LOGIT], apply,
                                      program.own_layers, program.own_part)
        # The rate this update used: the schedule runs on the optimizer's count,
        # which skipped steps do not advance.
        metrics = step_metrics(cfg, program.mesh, loss, ce, aux, grad_norm,
                               lr_at(state.opt_state.count), finite, program.tokens(rows, extra))
        bad_steps = jnp.where(finite, 0, state.bad_steps + 1)
        metrics["bad_steps"] = bad_steps
        metrics["overflowed"] = overflowed.astype(jnp.int32)
        return TrainState(state.step + (~overflowed).astype(state.step.dtype),
                          program.gathered(params),
                          new_buffers(cfg, program, state, aux, apply), opt_state,
                          state.key, bad_steps), metrics

    return train_step


def make_score_step(program, score_fn: Callable) -> Callable:
    """Scores rows through the same program as training (`make_score_fn`'s outputs)."""

    def score_step(params, buffers, batch_BxL1: jax.Array, mask_BxL: jax.Array):
        logprob_B, greedy_B = score_fn(program.working(params), buffers,
                                       program.own_rows(batch_BxL1),
                                       program.own_rows(mask_BxL, extra=0))
        return {"logprob": program.per_row(logprob_B),
                "greedy": program.per_row(greedy_B, every=True)}

    return score_step


def _update(tx, params, opt_state, grads, grad_norm, finite, **extra):
    """The optimizer's step; a non-finite loss or gradient changes nothing (the
    optimizer applies the skip inside its fused update)."""
    with jax.named_scope("optimizer"):
        updates, opt_state = tx.update(grads, opt_state, params, skip=~finite,
                                       grad_norm=grad_norm, **extra)
        return optax.apply_updates(params, updates), opt_state


def apply_gradients(tx: optax.GradientTransformationExtraArgs, params, opt_state, grads,
                    loss: jax.Array) -> tuple[Any, Any, jax.Array, jax.Array]:
    """One program's parameter update: (params, opt_state, grad_norm, finite)."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    return *_update(tx, params, opt_state, grads, grad_norm, finite), grad_norm, finite


def build_steps(cfg: Config, mesh: Mesh) -> Steps:
    """Compiles init, train and eval steps for `cfg` on `mesh`."""
    check_mesh(cfg, mesh)
    graphdef, abs_params, abs_buffers = abstract_model(cfg)
    per_device = uses_per_device_step(cfg)
    program = (DeviceProgram if per_device else AutoProgram)(cfg, mesh, abs_params)
    tx = make_optimizer(cfg.optimizer, cfg.train.steps)
    lr_at = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    shardings = state_shardings(cfg, program, tx, abs_params, abs_buffers)
    batch_sh = program.batch_sharding

    def init(key):
        # the same model on any mesh, made as the program holds it (each stage's chunks
        # drawn on that stage)
        model = Transformer.of(cfg, nnx.Rngs(params=key), held=program.stack)
        _, params, buffers = nnx.split(model, nnx.Param, ...)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, buffers, tx.init(params), key, zero)

    if cfg.pipeline.schedule == "1f1b" and program.stack is not None:
        gradients = functools.partial(pipelined_gradients, cfg, graphdef, program.layout)
    else:
        gradients = functools.partial(accumulate_gradients,
                                      make_loss_fn(cfg, graphdef, program.loss_layout), cfg)
    train_step = make_train_step(cfg, program, gradients, tx, lr_at)
    on_mesh = lambda f: f  # noqa: E731
    if per_device:
        specs = jax.tree.map(lambda s: s.spec, shardings,
                             is_leaf=lambda x: isinstance(x, NamedSharding))
        train_step = jax.shard_map(train_step, mesh=mesh, in_specs=(specs, P(BATCH_AXES)),
                                   out_specs=(specs, P()), check_vma=True)
        rows = P(BATCH_AXES)
        on_mesh = lambda f: jax.shard_map(  # noqa: E731
            f, mesh=mesh, in_specs=(specs.params, specs.buffers, rows, rows),
            out_specs={"logprob": rows, "greedy": rows}, check_vma=True)

    # the same parameters with buffers that drop nothing: only the model's MoE config differs
    dropless_graphdef = abstract_model(dropless(cfg))[0]
    rep = sharding.replicated(mesh)
    options = program.layout.kernels.compiler_options

    def scoring(model_graphdef):
        step = on_mesh(make_score_step(program, make_score_fn(cfg, model_graphdef,
                                                                 program.layout)))
        return jax.jit(step, in_shardings=(shardings.params, shardings.buffers, batch_sh, batch_sh),
                       out_shardings=rep, compiler_options=options)

    return Steps(
        cfg=cfg, mesh=mesh, program=program, graphdef=graphdef, state_shardings=shardings,
        batch_sharding=batch_sh,
        init=jax.jit(init, in_shardings=rep, out_shardings=shardings, compiler_options=options),
        train_step=jax.jit(train_step, in_shardings=(shardings, batch_sh),
                           out_shardings=(shardings, rep), donate_argnums=0,
                           compiler_options=options),
        eval_step=scoring(graphdef), score_step=scoring(dropless_graphdef),
    )


