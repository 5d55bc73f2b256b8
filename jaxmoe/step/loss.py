"""The loss a step differentiates, summed over its accumulation slices, and the step's
metrics.

`make_loss_fn` is the model's next-token loss plus the multi-token prediction and router
losses of the rows a program gives it; `accumulate_gradients` sums its gradients over
`train.accumulation_steps` slices in one traced copy of the model; `make_score_fn` is
the scoring steps' forward (held-out loss, downstream tasks).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import Config
from jaxmoe.model.attention import MAX_LOGIT, MAX_STATS, combined, unmeasured
from jaxmoe.model.mx_weights import mx_copies, with_mx_copies
from jaxmoe.model.layout import LocalLayout
from jaxmoe.model.load_metrics import load_metrics
from jaxmoe.model.moe import MEAN_STATS
from jaxmoe.ops.vma import vary, varying_axes
from jaxmoe.step.program import cast_matrices


def make_loss_fn(cfg: Config, graphdef: nnx.GraphDef, layout: LocalLayout) -> Callable:
    """`loss_fn(working, buffers, tokens_BxLn, key, copies) -> (loss, (ce, aux))`: the
    mean next-token loss of the rows given, plus the multi-token prediction and
    router losses, of the working copy of the parameters (the one the model computes
    with); `copies`: its weights' MXFP8 copies (`mx_copies`; {} where none computes
    in MXFP8). tokens_BxLn: each row's inputs and the `tokens_after` tokens
    after them. With MTP modules their layers' router stats follow the main
    layers' in aux, and aux["mtp_ce"] holds their cross-entropies."""
    has_moe, moe, t = cfg.num_moe_layers > 0, cfg.moe, cfg.train
    N = cfg.model.mtp_layers

    def loss_fn(working, buffers, tokens_BxLn, key, copies):
        model = nnx.merge(graphdef, with_mx_copies(working, copies, cfg, layout.kernels), buffers)
        tokens_BxLn = layout.rows_outside_stack(tokens_BxLn)
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
        copies = mx_copies(working, cfg)  # the precisions the model trains in
        model = nnx.merge(graphdef, with_mx_copies(working, copies, cfg, layout.kernels),
                          buffers)
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
        copies = mx_copies(params, cfg)  # once per step, for every slice and pass
    dtype = cfg.train.grad_accum_dtype if A > 1 else "float32"

    def one_slice(i, tokens):
        key = jax.random.fold_in(step_key, i) if cfg.moe.router_jitter > 0 else None
        (loss, (ce, aux)), grads = grad_fn(params, buffers, tokens, key, copies)
        grads = cast_matrices(jax.tree.map(lambda g: g.astype(jnp.float32), grads), dtype)
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
    zero_grads = cast_matrices(jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params),
                                dtype)
    zeros = (zero_grads, *jax.tree.map(_zeros, (loss, ce)),
             {k: unmeasured(k, _zeros(a)) for k, a in aux.items()})
    sums, _ = jax.lax.scan(add, zeros, (jnp.arange(A), slices_AxBxL1))
    return sums


def _zeros(a: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of a's shape and dtype that vary over the same mesh axes as a."""
    return vary(jnp.zeros(a.shape, a.dtype), varying_axes(a))


def step_metrics(cfg: Config, mesh, loss, ce, aux, grad_norm, lr, finite, num_tokens: int):
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
        metrics |= load_metrics(aux, num_tokens, cfg.moe.top_k, mesh.shape["expert"],
                                cfg.moe.balance_loss_weight)
    return metrics


def overflowed_buffers(cfg: Config, aux) -> jax.Array:
    """Whether a step dropped routed copies that `moe.on_overflow` will not lose (False
    where it drops them, or without MoE layers)."""
    if not cfg.num_moe_layers or cfg.moe.on_overflow == "drop":
        return jnp.zeros((), bool)
    return jnp.sum(aux["dropped"]) > 0
