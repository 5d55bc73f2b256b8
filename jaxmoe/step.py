"""Sharded init, the pure train step and the scoring steps, compiled once per (config, mesh).

`train_step(state, batch) -> (state, metrics)` is a pure function jitted with
explicit shardings and the state donated. Randomness comes from
`fold_in(state.key, step)`. Metrics stay on device as arrays. The scoring steps
run the model forward through the same program as training: `eval_step` at the
training capacity (the held-out loss), `score_step` dropless (downstream tasks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmoe import qk_clip, sharding
from jaxmoe.config import Config, ConfigError, dropless
from jaxmoe.model.attention import MAX_LOGIT, MAX_STATS, combined, unmeasured
from jaxmoe.model.experts import mx_copies, with_mx_copies
from jaxmoe.model.layout import LocalLayout
from jaxmoe.model.load_metrics import load_metrics
from jaxmoe.model.moe import MEAN_STATS
from jaxmoe.model.transformer import Transformer, in_moe_stack
from jaxmoe.muon import on_one_device
from jaxmoe.ops.vma import vary, varying_axes
from jaxmoe.optim import (learning_rate_schedule, make_optimizer, param_name, param_names,
                          unmatched_patterns, updates_are_elementwise)
from jaxmoe.parallel import context, ddp
from jaxmoe.parallel.layout import DeviceLayout, GlobalLayout
from jaxmoe.sharding import BATCH_AXES, TOKEN_AXES


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
    layout: GlobalLayout  # where the state lives (MoE stacks by pipeline stage)
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
        return nnx.merge(self.graphdef, self.layout.in_model_order(state.params),
                         self.layout.in_model_order(state.buffers))


def abstract_model(cfg: Config) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, params, buffers) of the model, abstract: the same for every mesh."""
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    return nnx.split(model, nnx.Param, ...)


def state_shardings(cfg: Config, layout: GlobalLayout, tx: optax.GradientTransformation,
                    abs_params: nnx.State, abs_buffers: nnx.State) -> TrainState:
    """Where each part of the state lives (`abs_params`, `abs_buffers`: the model's).

    ZeRO-1 splits optimizer state over each tensor's replica axes; with bf16
    compute the fp32 master weights are split the same way and a bf16 working
    copy is gathered inside the step.
    """
    stored = jax.eval_shape(layout.stored, abs_params)
    param_specs = layout.param_specs(abs_params)
    zero1 = layout.optimizer_specs(stored, param_specs)
    abs_opt = jax.eval_shape(tx.init, stored)
    # Each copy of the parameter tree in the optimizer state is placed like the
    # parameters' ZeRO-1 shards where its tensors have the parameters' shapes; the
    # rest (step counts, an optax optimizer's factored statistics) is replicated.
    opt_specs = optax.tree_map_params(
        tx, lambda a, spec, p: spec if a.shape == p.shape else P(), abs_opt, zero1, stored,
        transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
    if _sharded_master(cfg):
        param_specs = zero1
    specs = TrainState(P(), param_specs, layout.buffer_specs(abs_buffers), opt_specs, P(), P())
    return sharding.named(layout.mesh, specs)


def make_loss_fn(cfg: Config, graphdef: nnx.GraphDef, layout: LocalLayout) -> Callable:
    """`loss_fn(working, buffers, tokens_BxLn, key, copies) -> (loss, (ce, aux))`: the
    mean next-token loss of the rows given, plus the multi-token prediction and
    router losses, of the working copy of the parameters (the one the model computes
    with); `copies`: its expert weights' MXFP8 copies (`mx_copies`; {} without MXFP8
    experts). tokens_BxLn: each row's inputs and the `tokens_after` tokens
    after them. With MTP modules their layers' router stats follow the main
    layers' in aux, and aux["mtp_ce"] holds their cross-entropies."""
    has_moe, moe, t = cfg.num_moe_layers > 0, cfg.moe, cfg.train
    N = cfg.model.mtp_layers

    def loss_fn(working, buffers, tokens_BxLn, key, copies):
        model = nnx.merge(graphdef, with_mx_copies(working, copies), buffers)
        tokens_BxLn = layout.own_rows(tokens_BxLn)
        L = tokens_BxLn.shape[1] - tokens_after(cfg)
        x, aux = model.hidden(tokens_BxLn[:, :L], layout=layout, key=key, remat=t.remat)
        ce = model.cross_entropy(x, tokens_BxLn[:, 1:L + 1], layout, t.loss_chunk)
        ce = layout.output_share(ce)
        loss = ce
        if N:
            mtp_ce, mtp_aux = model.mtp_losses(x, tokens_BxLn, layout=layout, key=key,
                                               remat=t.remat, chunk=t.loss_chunk)
            mtp_ce = layout.output_share(mtp_ce)
            mtp_aux = {k: _output_part(layout, k)(v) for k, v in mtp_aux.items()}
            loss += t.mtp_loss_weight * jnp.mean(mtp_ce)
            aux = {**{k: jnp.concatenate([v, mtp_aux[k]]) for k, v in aux.items()},
                   "mtp_ce": mtp_ce}
        if has_moe:
            loss += moe.balance_loss_weight * jnp.mean(aux["balance_loss"])
            loss += moe.z_loss_weight * jnp.mean(aux["z_loss"])
        return loss, (ce, aux)

    return loss_fn


def _output_part(layout, key: str) -> Callable:
    """How a program contributes aux entry `key` of layers after the MoE stack."""
    if key in MEAN_STATS:
        return layout.output_share
    return layout.output_max if key in MAX_STATS else layout.output_sum


def make_score_fn(cfg: Config, graphdef: nnx.GraphDef, layout: LocalLayout) -> Callable:
    """`score_fn(working, buffers, tokens_BxL1, mask_BxL) -> (logprob_B, greedy_B)`: each
    row's summed log-probability of the targets its mask selects, and 1.0 where every
    one of them is the model's argmax (0.0 otherwise)."""

    def score_fn(working, buffers, tokens_BxL1, mask_BxL):
        model = nnx.merge(graphdef, working, buffers)
        x, _ = model.hidden(tokens_BxL1[:, :-1], layout=layout)
        logprob_BxL, greedy_BxL = model.target_logprobs(x, tokens_BxL1[:, 1:], layout,
                                                        cfg.train.loss_chunk)
        logprob_B = jnp.sum(jnp.where(mask_BxL, logprob_BxL, 0.0), axis=1)
        greedy_B = jnp.all(greedy_BxL | ~mask_BxL, axis=1).astype(jnp.float32)
        return layout.output_share(logprob_B), layout.output_share(greedy_B)

    return score_fn


def tokens_after(cfg: Config) -> int:
    """How many tokens a training row holds after its inputs: the last input's
    target, and one further target per multi-token prediction module."""
    return 1 + cfg.model.mtp_layers


def with_tokens_after(cfg: Config, rows_BxL1: jax.Array) -> jax.Array:
    """Rows of L + 1 tokens padded with zeros to L + `tokens_after` (targets past a
    row's end, which multi-token prediction does not count)."""
    return jnp.pad(rows_BxL1, ((0, 0), (0, cfg.model.mtp_layers)))


# per-shard means among the losses' aux: totalled over shards, they are divided by their count
SHARD_MEANS = (*MEAN_STATS, "mtp_ce")


def accumulate_gradients(loss_fn: Callable, cfg: Config, params, buffers, batch_BxL1: jax.Array,
                         step_key: jax.Array):
    """Sums over the `train.accumulation_steps` slices of `batch_BxL1`: gradients
    w.r.t. `params` (matrices in `train.grad_accum_dtype`, the rest fp32), loss, ce
    and router stats (divide by the count)."""
    A = cfg.train.accumulation_steps
    B, L1 = batch_BxL1.shape
    # Strided split keeps each device's rows on that device in every slice.
    slices_AxBxL1 = batch_BxL1.reshape(B // A, A, L1).swapaxes(0, 1)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    with jax.named_scope("working_copy"):
        copies = mx_copies(params, cfg.moe)  # once per step, for every slice and pass
    dtype = cfg.train.grad_accum_dtype if A > 1 else "float32"

    def one_slice(i, tokens):
        key = jax.random.fold_in(step_key, i) if cfg.moe.router_jitter > 0 else None
        (loss, (ce, aux)), grads = grad_fn(params, buffers, tokens, key, copies)
        grads = _cast_matrices(jax.tree.map(lambda g: g.astype(jnp.float32), grads), dtype)
        return grads, loss, ce, aux

    if A == 1:  # no accumulation loop: no zeroed gradient tree to add into
        return one_slice(0, slices_AxBxL1[0])

    def add(sums, xs):  # one traced copy of the model, looped
        *totals, aux = one_slice(*xs)
        with jax.named_scope("accumulate"):
            totals = jax.tree.map(jnp.add, sums[:-1], tuple(totals))
            return (*totals, {k: combined(k, sums[-1][k], a) for k, a in aux.items()}), None

    # forward only: the shapes (and, per device, the varying axes) of loss, ce and stats
    loss, (ce, aux) = jax.eval_shape(loss_fn, params, buffers, slices_AxBxL1[0], None, copies)
    zero_grads = _cast_matrices(jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params),
                                dtype)
    zeros = (zero_grads, *jax.tree.map(_zeros, (loss, ce)),
             {k: unmeasured(k, _zeros(a)) for k, a in aux.items()})
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
    if cfg.model.mtp_layers:
        metrics |= {"mtp_ce": jnp.mean(aux["mtp_ce"]) / A, "mtp_ce_depth": aux["mtp_ce"] / A}
    if cfg.optimizer.qk_clip:  # per layer, model order, MTP layers last
        metrics |= {"max_logit": jnp.max(aux[MAX_LOGIT], axis=-1),
                    "qk_clipped": jnp.sum(aux[MAX_LOGIT] > cfg.optimizer.qk_clip, axis=-1)}
    if cfg.num_moe_layers:
        aux = {**aux, **{k: aux[k] / A for k in MEAN_STATS}}
        metrics |= {k: jnp.mean(aux[k]) for k in MEAN_STATS}
        metrics |= load_metrics(aux, num_tokens, cfg.moe.top_k, layout.mesh.shape["expert"],
                                cfg.moe.balance_loss_weight)
    return metrics


def overflowed_buffers(cfg: Config, aux) -> jax.Array:
    """Whether a step dropped routed copies that `moe.on_overflow` will not lose (False
    where it drops them, or without MoE layers)."""
    if not cfg.num_moe_layers or cfg.moe.on_overflow == "drop":
        return jnp.zeros((), bool)
    return jnp.sum(aux["dropped"]) > 0


def new_buffers(cfg: Config, layout, state: TrainState, aux, finite) -> nnx.State:
    """Router biases after the step (unchanged on a skipped one)."""
    buffers = state.buffers
    if cfg.num_moe_layers and cfg.moe.expert_bias:
        buffers = update_expert_bias(buffers, aux["counts"], cfg.moe.bias_update_rate,
                                     layout.own_share, cfg.model.mtp_layers)
    return jax.tree.map(lambda new, old: jnp.where(finite, new, old), buffers, state.buffers)


# ---------------------------------------------------------------- the two programs

# Every step: the working copy of the parameters; the gradients summed over the
# accumulation slices and reduced; the losses and stats totalled; the norm, the
# finite check and skip; the optimizer's update of the parameters it owns, then
# gathered. What differs between the programs is each of those verbs:


class AutoProgram:
    """fsdp: one program on global arrays; XLA places the reductions (inside the
    accumulation loop, as it chooses)."""

    def __init__(self, cfg: Config, layout: GlobalLayout, use_specs: nnx.State):
        self.cfg, self.layout, self.use_specs = cfg, layout, use_specs

    def start(self, step_key, batch_BxLn, extra: int = 1):
        return step_key, self.own_rows(batch_BxLn, extra)

    def own_rows(self, batch_BxN, extra: int = 1):
        return batch_BxN

    def per_row(self, x_B, every: bool = False):
        return x_B

    def working(self, params):
        return working_copy(self.cfg, self.layout.mesh, params, self.use_specs)

    def reduce(self, grads):
        return jax.tree.map(lambda g: g.astype(jnp.float32) / self.cfg.train.accumulation_steps,
                            grads)

    def totals(self, loss, ce, aux):
        return loss, ce, aux

    def norm(self, grads):
        return optax.tree.norm(grads)

    def own(self, params):
        return params

    def gathered(self, params):
        return params

    def tokens(self, rows_BxLn, extra: int = 1) -> int:
        return rows_BxLn.shape[0] * (rows_BxLn.shape[1] - extra)

    whole_matrices = staticmethod(on_one_device)  # global arrays: every matrix is whole

    @staticmethod
    def own_part(name: str, x):  # global arrays: the whole tensor is the program's
        return x


class DeviceProgram:
    """ddp: one device's program inside a `shard_map` over the whole mesh.

    Each device runs the model on its own rows with its dense replicas and its
    experts (and stage); gradients accumulate locally and are reduced once at the
    end, into the ZeRO-1 shards (`jaxmoe.parallel.ddp`), where the optimizer
    updates them; the new shards are gathered once.
    """

    def __init__(self, cfg: Config, layout: DeviceLayout, use_specs: nnx.State,
                 shard_specs: nnx.State):
        self.cfg, self.layout, self.mesh = cfg, layout, layout.mesh
        self.plans = ddp.reductions(use_specs, shard_specs, self.mesh)
        self.sharded_master = _sharded_master(cfg)
        self.context = sharding.axis_size(self.mesh, "context")
        # devices holding different tokens: what the losses and gradients average over
        self.n_shards = math.prod(sharding.axis_size(self.mesh, a) for a in TOKEN_AXES)
        self.deferred = jax.tree_util.tree_map_with_path(self._defers, self.plans)
        self.plan_of = {param_name(path): r for path, r in jax.tree_util.tree_leaves_with_path(
            self.plans, is_leaf=lambda x: isinstance(x, ddp.Reduction))}

    def _defers(self, path, r: ddp.Reduction) -> bool:
        """Whether a parameter reaches the model as its ZeRO-1 shard, for a circular
        pipeline to gather round by round and reduce its gradient in the same loop
        (`device_pipeline`): a stage-held stack's tensor split only by ZeRO-1 over all
        its replica axes, in a step of one slice that reduces in the compute dtype."""
        cfg = self.cfg
        return (self.layout.stack is not None and cfg.pipeline.virtual_stages > 1
                and in_moe_stack(path) and self.sharded_master
                and cfg.train.accumulation_steps == 1
                and cfg.train.grad_reduce_dtype == cfg.model.compute_dtype
                and bool(r.scatter_axes) and r.dim >= 2
                and all(self.mesh.shape[a] == 1 for a in r.sum_axes))

    def start(self, step_key, rows_bxLn, extra: int = 1):
        # own router jitter
        key = jax.random.fold_in(step_key, jax.lax.axis_index(TOKEN_AXES))
        return key, self.own_rows(rows_bxLn, extra)

    def own_rows(self, rows_bxN, extra: int = 1):
        """This device's part of its rows: under `context` its chunk of their positions
        (and the `extra` tokens after it, `tokens_after`). Rows, like the
        weights, vary over every axis (stage included), so that no use of a weight
        implies a reduction of its gradient."""
        if self.context > 1:
            rows_bxN = context.own_chunk(rows_bxN, (rows_bxN.shape[1] - extra) // self.context,
                                         extra)
        return vary(rows_bxN, ("stage", "context"))

    def per_row(self, x_b, every: bool = False):
        """A per-row value from the stage that holds the model's output (`output_share`
        zeroed it elsewhere), over the row's chunks: their sum, or (`every`, for 0/1
        flags) whether every chunk's is 1."""
        x_b = jax.lax.psum(x_b, "stage")
        return jax.lax.pmin(x_b, "context") if every else jax.lax.psum(x_b, "context")

    def working(self, params):
        """Cast, then (ZeRO-1 bf16 masters) gathered, then per device: made once a step;
        the deferred shards as they are (`ddp.Sharded`)."""
        working = _cast_matrices(params, self.cfg.model.compute_dtype)

        def place(w, r, deferred):
            if deferred:
                return ddp.Sharded(w, r)
            return ddp.to_per_device(ddp.gather_shards(w, r) if self.sharded_master else w, r)

        return jax.tree.map(place, working, self.plans, self.deferred)

    def reduce(self, grads):
        scale = 1.0 / (self.n_shards * self.cfg.train.accumulation_steps)
        grads = _cast_matrices(grads, self.cfg.train.grad_reduce_dtype)  # float32: no-op

        def reduced(r, deferred, g):  # a deferred shard's gradient arrives reduced
            g = g.shard if deferred else ddp.reduce_gradient(g, r)
            return g.astype(jnp.float32) * scale

        return jax.tree.map(reduced, self.plans, self.deferred, grads)

    def totals(self, loss, ce, aux):
        # over every axis: stages hold disjoint layers (zeros elsewhere) and the
        # last stage's loss, or a share of it each (`output_share`)
        total = lambda v: ddp.psum_everywhere(v, self.mesh.axis_names)  # noqa: E731
        largest = lambda v: lax.pmax(vary(v, self.mesh.axis_names), self.mesh.axis_names)  # noqa: E731
        aux = {k: largest(v) if k in MAX_STATS else
               total(v) / (self.n_shards if k in SHARD_MEANS else 1) for k, v in aux.items()}
        return total(loss) / self.n_shards, total(ce) / self.n_shards, aux

    def norm(self, grads):
        return ddp.global_norm(grads, self.plans, self.mesh)

    def own(self, params):
        return params if self.sharded_master else jax.tree.map(ddp.own_shard, params, self.plans)

    def gathered(self, params):
        return params if self.sharded_master else jax.tree.map(ddp.gather_shards, params,
                                                               self.plans)

    def tokens(self, rows_bxLn, extra: int = 1) -> int:
        return self.n_shards * rows_bxLn.shape[0] * (rows_bxLn.shape[1] - extra)

    def own_part(self, name: str, x):
        """This device's ZeRO-1 part of x, a value of parameter `name`'s shape or one
        that broadcasts against it (size 1 along the split: all of it)."""
        r = self.plan_of[name]
        return x if not r.scatter_axes or x.shape[r.dim] == 1 else ddp.own_shard(x, r)

    def whole_matrices(self, name: str, x, view, fn):
        """fn of the whole matrices of `x`, this device's ZeRO-1 part of parameter
        `name`'s update (Muon's orthogonalization): this device's part of the result.

        Each matrix is orthogonalized whole, once, by one device: where ZeRO-1 split
        a batch of matrices (layers, experts, a pipeline's chunks), each device holds
        whole ones already and nothing moves; where it split the matrices
        themselves, an all-to-all deals the batch out instead (each device then
        holds its 1/n of the matrices, whole), and a second brings the results
        back. A batch that does not divide among the n devices (one dense layer's
        matrix, say) is padded with zero matrices to one that does (their
        orthogonalization is zero, and is dropped)."""
        r = self.plan_of[name]
        batch = view.batch_axes(x.ndim)
        if not r.scatter_axes or r.dim < batch:
            return fn(x)
        n = math.prod(self.mesh.shape[a] for a in r.scatter_axes)
        count = math.prod(x.shape[:batch])
        padded = -(-count // n) * n
        split = 1 + r.dim - batch  # the split axis of [count, matrix axes...]
        flat = x.reshape(count, *x.shape[batch:])
        if padded > count:
            flat = jnp.concatenate([flat, jnp.zeros((padded - count, *flat.shape[1:]), x.dtype)])
        dealt = lax.all_to_all(flat, r.scatter_axes, 0, split, tiled=True)
        back = lax.all_to_all(fn(dealt), r.scatter_axes, split, 0, tiled=True)
        return back[:count].reshape(x.shape)


def make_train_step(cfg: Config, program, loss_fn: Callable, tx, lr_at) -> Callable:
    """The one train step body, for either program."""

    def train_step(state: TrainState, batch_BxL1: jax.Array):
        extra = tokens_after(cfg)
        step_key, rows = program.start(jax.random.fold_in(state.key, state.step),
                                       with_tokens_after(cfg, batch_BxL1), extra)
        with jax.named_scope("working_copy"):
            working = program.working(state.params)
        grads, loss, ce, aux = accumulate_gradients(loss_fn, cfg, working, state.buffers, rows,
                                                    step_key)
        with jax.named_scope("reduce"):
            grads = program.reduce(grads)
        loss, ce, aux = program.totals(loss, ce, aux)
        grad_norm = program.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # a step to be run again at larger capacity (`jaxmoe.overflow`) changes nothing,
        # its step count included, so the rerun draws the same keys
        overflowed = overflowed_buffers(cfg, aux)
        apply = finite & ~overflowed
        # Muon's matrices, whole wherever the program splits them
        whole = {"whole_matrices": program.whole_matrices} if cfg.optimizer.name == "muon" else {}
        params, opt_state = _update(tx, program.own(state.params), state.opt_state, grads,
                                    grad_norm, apply, **whole)
        if cfg.optimizer.qk_clip:
            params = qk_clip.rescaled(cfg, params, aux[MAX_LOGIT], apply,
                                      program.layout.own_share, program.own_part)
        # The rate this update used: the schedule runs on the optimizer's count,
        # which skipped steps do not advance.
        metrics = step_metrics(cfg, program.layout, loss, ce, aux, grad_norm,
                               lr_at(state.opt_state.count), finite, program.tokens(rows, extra))
        bad_steps = jnp.where(finite, 0, state.bad_steps + 1)
        metrics["bad_steps"] = bad_steps
        metrics["overflowed"] = overflowed.astype(jnp.int32)
        return TrainState(state.step + (~overflowed).astype(state.step.dtype),
                          program.gathered(params),
                          new_buffers(cfg, program.layout, state, aux, apply), opt_state,
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


def working_copy(cfg: Config, mesh: Mesh, params: nnx.State, specs: nnx.State) -> nnx.State:
    """Matrices cast to the compute dtype and placed where they are used; norms and
    the router stay fp32. The identity for fp32 compute."""
    if cfg.model.compute_dtype == "float32":
        return params
    return jax.tree.map(lambda p, spec: jax.lax.with_sharding_constraint(
        p, NamedSharding(mesh, spec)), _cast_matrices(params, cfg.model.compute_dtype), specs,
        is_leaf=lambda x: isinstance(x, P))


def _cast_matrices(params, dtype):
    """Matrices in `dtype`; norms, biases and the router stay fp32 whatever the
    compute dtype."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p if _stays_fp32(path, p) else p.astype(dtype), params)


def _stays_fp32(path, p) -> bool:
    return p.ndim < 2 or "router" in jax.tree_util.keystr(path)


def _sharded_master(cfg: Config) -> bool:
    """Whether the fp32 master weights live in ZeRO-1 shards (see `state_shardings`)."""
    return cfg.mesh.zero1 and cfg.model.compute_dtype != "float32"


def uses_per_device_step(cfg: Config) -> bool:
    """ddp trains (and evaluates) with the per-device program, pipelines included."""
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
    shard_specs = layout.optimizer_specs(jax.eval_shape(layout.stored, abs_params), use_specs)
    check_optimizer(cfg, mesh, abs_params, shard_specs)

    def init(key):
        # the same model on any mesh, made as the layout holds it (each stage's chunks
        # drawn on that stage)
        model = Transformer(cfg, nnx.Rngs(params=key), held=layout.stack)
        _, params, buffers = nnx.split(model, nnx.Param, ...)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, buffers, tx.init(params), key, zero)

    # the same parameters with buffers that drop nothing: only the model's MoE config differs
    dropless_graphdef = abstract_model(dropless(cfg))[0]
    if uses_per_device_step(cfg):
        model_layout = DeviceLayout(mesh, cfg)
        program = DeviceProgram(cfg, model_layout, use_specs, shard_specs)
        specs = jax.tree.map(lambda s: s.spec, shardings,
                             is_leaf=lambda x: isinstance(x, NamedSharding))
        # a loss slice's rows per device
        rows = cfg.train.batch_size // math.prod(mesh.shape[a] for a in BATCH_AXES)
        loss_layout = model_layout.rows_split_over_stages(rows // cfg.train.accumulation_steps)
        train_step = jax.shard_map(
            make_train_step(cfg, program, make_loss_fn(cfg, graphdef, loss_layout), tx, lr_at),
            mesh=mesh, in_specs=(specs, P(BATCH_AXES)), out_specs=(specs, P()), check_vma=True)
        rows = P(BATCH_AXES)
        on_mesh = lambda f: jax.shard_map(  # noqa: E731
            f, mesh=mesh, in_specs=(specs.params, specs.buffers, rows, rows),
            out_specs={"logprob": rows, "greedy": rows}, check_vma=True)
    else:
        model_layout = layout
        program = AutoProgram(cfg, layout, use_specs)
        train_step = make_train_step(cfg, program, make_loss_fn(cfg, graphdef, layout), tx, lr_at)
        on_mesh = lambda f: f  # noqa: E731

    rep = sharding.replicated(mesh)
    options = layout.kernels.compiler_options

    def scoring(model_graphdef):
        step = on_mesh(make_score_step(program, make_score_fn(cfg, model_graphdef,
                                                                 model_layout)))
        return jax.jit(step, in_shardings=(shardings.params, shardings.buffers, batch_sh, batch_sh),
                       out_shardings=rep, compiler_options=options)

    return Steps(
        cfg=cfg, mesh=mesh, layout=layout, graphdef=graphdef, state_shardings=shardings,
        batch_sharding=batch_sh,
        init=jax.jit(init, in_shardings=rep, out_shardings=shardings, compiler_options=options),
        train_step=jax.jit(train_step, in_shardings=(shardings, batch_sh),
                           out_shardings=(shardings, rep), donate_argnums=0,
                           compiler_options=options),
        eval_step=scoring(graphdef), score_step=scoring(dropless_graphdef),
    )


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
    split = any(mesh.shape[a] > 1 for spec in specs for entry in spec
                for a in sharding.spec_axes(entry))
    # (Muon's matrices are made whole by the step: `DeviceProgram.whole_matrices`)
    if uses_per_device_step(cfg) and split and o.name != "muon" and not updates_are_elementwise(o):
        raise ConfigError(f"optimizer.name: {o.name} takes statistics over whole tensors, but "
                          "the ddp step updates each device's part of a tensor (its ZeRO-1 "
                          "shard, its experts, its stage's layers) on its own; use "
                          "mesh.parallelism: fsdp, or an optimizer that updates each element "
                          "on its own (adamw, lion, sgd, ...)")


def update_expert_bias(buffers: nnx.State, counts_LxE: jax.Array, rate: float,
                       place: Callable = lambda delta: delta, mtp_layers: int = 0) -> nnx.State:
    """Aux-loss-free balancing: nudge each expert's selection bias toward mean load.

    Uses the step's requested counts summed over the global batch, in model order
    (the MoE layers', then the `mtp_layers` multi-token prediction modules'), once per
    optimizer step, however often a layer was recomputed. `place` puts the MoE
    layers' updates where `buffers` hold their layers (a layout's `own_share`: a
    pipeline stage's chunks, zero for padding slots).
    """
    counts = counts_LxE.astype(jnp.float32)
    delta = rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)
    Lm = counts.shape[0] - mtp_layers
    main, mtp = place(delta[:Lm]), delta[Lm:]

    def nudge(path, b):  # a new tree: the step's input state must stay untouched
        if "router" not in jax.tree_util.keystr(path):
            return b
        return b + (mtp if any(getattr(k, "key", None) == "mtp_layers" for k in path) else main)

    return jax.tree_util.tree_map_with_path(nudge, buffers)


def with_weights(steps: Steps, state: TrainState, weights: dict) -> TrainState:
    """`state` with these weights (see `place_weights`). The optimizer state stays."""
    params, buffers = place_weights(steps, weights)
    return state._replace(params=params, buffers=buffers)


def place_weights(steps: Steps, weights: dict) -> tuple[nnx.State, nnx.State]:
    """(params, buffers) of a plain dict of weights in model order, router biases
    included (what `jaxmoe.load_params` and `jaxmoe.hf.load_hf` give), stored as the
    layout keeps them and placed on the mesh: what the steps take."""
    _, params, buffers = abstract_model(steps.cfg)
    params.replace_by_pure_dict(_only(weights, params.to_pure_dict()))
    buffers.replace_by_pure_dict(_only(weights, buffers.to_pure_dict()))
    shardings, stored = steps.state_shardings, steps.layout.stored  # on the host
    return (jax.device_put(stored(params), shardings.params),
            jax.device_put(stored(buffers), shardings.buffers))


def check_shapes(got, want, label: str, extra: bool = False) -> None:
    """Raises ValueError naming the first leaf of `got` missing from `want`'s tree, not
    in it (unless `extra` leaves are allowed) or of another shape; `label` names `got`."""
    def shape(a):  # abstract arrays too
        return tuple(a.shape) if hasattr(a, "shape") else np.shape(a)

    want_shapes = {jax.tree_util.keystr(p): shape(a)
                   for p, a in jax.tree_util.tree_leaves_with_path(want)}
    try:
        got_shapes = {jax.tree_util.keystr(p): shape(a)
                      for p, a in jax.tree_util.tree_leaves_with_path(got)}
    except TypeError as e:
        raise ValueError(f"{label}: not a pytree of arrays ({e})") from None
    for key in sorted(want_shapes.keys() | got_shapes.keys()):
        if key not in got_shapes:
            raise ValueError(f"{label}{key}: missing for this config")
        if key not in want_shapes:
            if extra:
                continue
            raise ValueError(f"{label}{key}: not part of a model with this config")
        if got_shapes[key] != want_shapes[key]:
            raise ValueError(f"{label}{key}: shape {got_shapes[key]} does not match the "
                             f"config's {want_shapes[key]}")


def _only(weights: dict, like: dict) -> dict:
    """The entries of `weights` that `like` has (params or buffers), shapes checked,
    as float32 arrays."""
    check_shapes(weights, like, "weights", extra=True)
    got = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_leaves_with_path(weights)}
    return jax.tree_util.tree_map_with_path(
        lambda path, _: np.asarray(got[jax.tree_util.keystr(path)], np.float32), like)
