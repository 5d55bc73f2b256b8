"""The step's gradients through one interleaved 1F1B pass (`pipeline.schedule: 1f1b`).

`accumulate_gradients` differentiates each accumulation slice's loss, its pipeline a
loop that autodiff runs backward: a stage keeps every micro-batch's chunk inputs
until the loop's backward, so the slices run one after another, each filling and
draining the pipeline. Here the step's A slices of M micro-batches go through one
pass (`jaxmoe.parallel.one_f_one_b.device_pass`) that runs each chunk's backward as
soon as its cotangent arrives: a stage holds a fixed count of chunk inputs whatever
A M, and the pipeline fills and drains once a step.

The first chunk embeds its micro-batch's tokens and runs the dense layers in front
(`Transformer.front`); the last runs the final norm, the head, the loss and the
multi-token prediction modules. Each chunk adds its layers' balance and z losses.
Every op is recomputed from its input in its backward (`train.remat: full`) and
keeps what it needs there, for that one micro-batch. The result is
`accumulate_gradients`': gradients, losses and router statistics summed over the
slices, micro-batch k = a M + m holding the rows that slice a gives micro-batch m.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import Config
from jaxmoe.model.attention import MAX_LOGIT, MAX_STATS, unmeasured
from jaxmoe.model.moe import MEAN_STATS
from jaxmoe.model.mx_weights import mx_copies, with_mx_copies
from jaxmoe.model.transformer import scan_layers
from jaxmoe.parallel import lockstep
from jaxmoe.parallel.one_f_one_b import branches, device_pass
from jaxmoe.parallel.pipeline import per_layer
from jaxmoe.step.loss import tokens_after
from jaxmoe.step.program import cast_matrices

STACK = "moe_layers"  # the pipeline's part of the parameters; the rest is `outer`


def total_microbatches(cfg: Config) -> int:
    """The micro-batches of one pass: every accumulation slice's."""
    return cfg.train.accumulation_steps * cfg.pipeline.stage_microbatches


def lockstep_tables(cfg: Config, stages: int) -> lockstep.Tables:
    """The pass's tables on `stages` stages."""
    return lockstep.tables(lockstep.schedule(stages, cfg.pipeline.virtual_stages,
                                             total_microbatches(cfg)))


def step_branches(cfg: Config, stages: int) -> dict | None:
    """Which branches a 1F1B step's conditionals take, per (iteration, stage), for the
    planner's walk (`one_f_one_b.branches`); None for other schedules."""
    if cfg.pipeline.schedule != "1f1b" or stages == 1:
        return None
    return branches(lockstep_tables(cfg, stages))


def pipelined_gradients(cfg: Config, graphdef: nnx.GraphDef, layout, params, buffers,
                        rows_bxLn: jax.Array, step_key: jax.Array):
    """`accumulate_gradients`' (grads, loss, ce, aux) for one device of the ddp step:
    `layout` the device layout (its `stack` the stages' `StageStack`), `params` this
    device's working copy (the MoE stack's leaves [W, 1, per, ...])."""
    t, moe, N = cfg.train, cfg.moe, cfg.model.mtp_layers
    A, M = t.accumulation_steps, cfg.pipeline.stage_microbatches
    K, stack, Lm = total_microbatches(cfg), layout.stack, cfg.num_moe_layers
    b, Ln = rows_bxLn.shape
    L, r = Ln - tokens_after(cfg), b // K
    micro_KxrxLn = rows_bxLn.reshape(r, M, A, Ln).transpose(2, 1, 0, 3).reshape(K, r, Ln)
    positions_rxL = layout.positions(r, L)
    jitter = moe.router_jitter > 0
    layers_counted = Lm + (N if Lm else 0)  # the router losses' mean is over these

    outer = nnx.State({k: v for k, v in params.items() if k != STACK})
    outer_copies = mx_copies(outer, cfg)
    stack_params = nnx.State({STACK: params[STACK]})
    # the stack's module, its weights per round [W, per, ...] and its buffers
    stack_graphdef, _ = nnx.split(nnx.merge(graphdef, params, buffers).moe_layers)
    weights_W = jax.tree.map(lambda a: a[:, 0], params[STACK])
    buffers_W = jax.tree.map(lambda a: a[:, 0], buffers[STACK] if STACK in buffers else {})
    copies_W = mx_copies(weights_W, cfg)
    real_WxLp = jnp.take(stack.real(Lm), jax.lax.axis_index("stage"), axis=1)
    padded = stack.slots > Lm

    def key_of(k, v=0):  # the same noise in a chunk's forward and its recomputation
        return jax.random.fold_in(jax.random.fold_in(step_key, k), v) if jitter else None

    def model_of(o):
        return nnx.merge(graphdef, with_mx_copies(o, outer_copies, cfg, layout.kernels),
                         stack_params, buffers)

    def router_part(aux, scale):  # the chunk's share of the balance and z losses
        if not Lm:
            return 0.0
        return (moe.balance_loss_weight * jnp.sum(aux["balance_loss"])
                + moe.z_loss_weight * jnp.sum(aux["z_loss"])) / (layers_counted * scale)

    def tokens_of(k):  # micro-batch k's rows
        return jax.lax.dynamic_index_in_dim(micro_KxrxLn, k, keepdims=False)

    def first(o, k):
        return model_of(o).front(tokens_of(k)[:, :L], layout=layout)

    def chunk(w, x, k, v):
        copies = {p: jax.tree.map(lambda a: a[v], c) for p, c in copies_W.items()}
        state = nnx.merge(stack_graphdef, with_mx_copies(w, copies, cfg, layout.kernels),
                          jax.tree.map(lambda a: a[v], buffers_W))
        y, aux = scan_layers(stack_graphdef, nnx.split(state)[1], x, positions_rxL, layout,
                             key_of(k, v + 1), "none", unroll=True,
                             active_N=real_WxLp[v] if padded else None)
        return y, router_part(aux, M), aux

    def last(o, y, k):
        model, tokens_rxLn = model_of(o), tokens_of(k)
        ce = model.cross_entropy(y, tokens_rxLn[:, 1:L + 1], layout, t.loss_chunk)
        loss, stats = ce / M, {"ce": ce}
        if N:
            mtp_ce, mtp_aux = model.mtp_losses(y, tokens_rxLn, layout=layout, key=key_of(k),
                                               chunk=t.loss_chunk)
            loss += t.mtp_loss_weight * jnp.mean(mtp_ce) / M + router_part(mtp_aux, M)
            stats |= {"mtp_ce": mtp_ce, "mtp_aux": mtp_aux}
        return loss, stats

    tables = lockstep_tables(cfg, stack.stages)
    # summed in `train.grad_accum_dtype` (matrices) over slices, as accumulate_gradients
    dtype = jnp.dtype(t.grad_accum_dtype if A > 1 else "float32")
    sums = cast_matrices(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32),
                                      (weights_W, outer)), dtype)
    loss, grads_W, grads_outer, (first_T, chunk_T, last_T) = device_pass(
        tables, first, chunk, last, weights_W, outer, sums=sums)

    s = jax.lax.axis_index("stage")
    ran = lambda on: jnp.asarray(on)[:, s] == 1  # noqa: E731  per iteration, this stage
    b_on, b_last = ran(tables.b_on), ran(tables.b_on * tables.b_last)
    b_first = ran(tables.b_on * tables.b_first)
    mask = lambda on, stats: {k: jnp.where(on.reshape((-1,) + (1,) * (a.ndim - 1)), a,  # noqa: E731
                                           unmeasured(k, a)) for k, a in stats.items()}
    aux = per_layer(mask(b_on, chunk_T), jnp.asarray(tables.b_round)[:, s],
                    jnp.broadcast_to(s, b_on.shape), stack, Lm, M) if Lm else {}
    total = lambda k, a: jnp.max(a, axis=0) if k in MAX_STATS else jnp.sum(a, axis=0)  # noqa: E731
    if MAX_LOGIT in first_T:  # the dense layers' before the MoE layers'
        dense = total(MAX_LOGIT, mask(b_first, {MAX_LOGIT: first_T[MAX_LOGIT]})[MAX_LOGIT])
        aux[MAX_LOGIT] = jnp.concatenate([dense, *([aux[MAX_LOGIT]] if MAX_LOGIT in aux else [])])
    ce = jnp.sum(jnp.where(b_last, last_T["ce"], 0.0)) / M
    if N:
        mtp = {k: total(k, a) / (M if k in MEAN_STATS else 1)
               for k, a in mask(b_last, last_T["mtp_aux"]).items()}
        aux = {**{k: jnp.concatenate([a, mtp[k]]) for k, a in aux.items()},
               "mtp_ce": jnp.sum(jnp.where(b_last[:, None], last_T["mtp_ce"], 0.0), axis=0) / M}
    grads = nnx.State({**grads_outer, STACK: jax.tree.map(lambda g: g[:, None], grads_W)})
    grads = jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(grads))
    grads = cast_matrices(jax.tree.map(lambda g: g.astype(jnp.float32), grads), dtype)
    return grads, loss, ce, aux
