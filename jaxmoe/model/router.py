"""Token-choice router: fp32 scores, top-k selection, router losses.

The selection-only expert bias (aux-loss-free balancing) lives in an
`ExpertBias` variable, which is not an `nnx.Param`, so the optimizer never
sees it; the train step updates it from globally reduced expert loads (`update_expert_bias`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config import MoEConfig
from jaxmoe.model.layers import param
from jaxmoe.model.remat import ROUTER_LOGITS


class ExpertBias(nnx.Variable):
    """Per-expert selection bias, updated outside the optimizer."""


class Routing(NamedTuple):
    expert_TxK: jax.Array  # int32 chosen experts, best first
    gate_TxK: jax.Array  # fp32 combine weights
    probs_TxE: jax.Array  # fp32 scores normalised per token (for the balance loss)
    logits_TxE: jax.Array  # fp32 raw router logits (for the z-loss)
    margin_T: jax.Array  # fp32 gap between the k-th and (k+1)-th selection scores


def route(logits_TxE: jax.Array, cfg: MoEConfig, bias_E: jax.Array | None = None) -> Routing:
    """Top-k routing from fp32 logits; the bias only affects which experts are chosen."""
    logits_TxE = logits_TxE.astype(jnp.float32)
    if cfg.score_func == "softmax":
        scores_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    else:
        scores_TxE = jax.nn.sigmoid(logits_TxE)
    selection_TxE = scores_TxE if bias_E is None else scores_TxE + bias_E
    if cfg.routing_groups > 1:
        selection_TxE = within_best_groups(selection_TxE, cfg.routing_groups,
                                           cfg.groups_per_token)
    K, E = cfg.top_k, logits_TxE.shape[-1]
    # Reading a top-k output past its first columns (say the (K+1)-th score) makes
    # XLA:CPU sort every row in full, ~20x slower at 128 experts; the runner-up
    # is a masked max instead, and the K-th score the min of the K best.
    best_TxK, expert_TxK = jax.lax.top_k(selection_TxE, K)
    if K < E:
        chosen_TxE = jnp.any(expert_TxK[:, :, None] == jnp.arange(E), axis=1)
        runner_up_T = jnp.max(jnp.where(chosen_TxE, -jnp.inf, selection_TxE), axis=-1)
        # with groups, the runner-up is the best expert of the groups kept; none when
        # they held only the K chosen
        margin_T = jnp.where(runner_up_T > -jnp.inf, jnp.min(best_TxK, axis=-1) - runner_up_T,
                             0.0)
    else:
        margin_T = jnp.zeros(logits_TxE.shape[:1], jnp.float32)
    gate_TxK = jnp.take_along_axis(scores_TxE, expert_TxK, axis=-1)
    if cfg.renormalize:
        gate_TxK = gate_TxK / (jnp.sum(gate_TxK, axis=-1, keepdims=True) + 1e-9)
    if cfg.gate_scale != 1.0:
        gate_TxK = gate_TxK * cfg.gate_scale
    probs_TxE = scores_TxE / jnp.sum(scores_TxE, axis=-1, keepdims=True)
    return Routing(expert_TxK.astype(jnp.int32), gate_TxK, probs_TxE, logits_TxE,
                   jax.lax.stop_gradient(margin_T))


def within_best_groups(selection_TxE: jax.Array, groups: int, kept: int) -> jax.Array:
    """Selection scores with every expert outside a token's `kept` best groups at -inf.

    Experts form `groups` contiguous groups; a group's score is the sum of its two
    highest selection scores (bias included), DeepSeek-V3's rule, as transformers'
    DeepseekV3TopkRouter and Glm4MoeTopkRouter take it; ties go to the lower index.
    """
    T, E = selection_TxE.shape
    per_group_TxGxEg = selection_TxE.reshape(T, groups, E // groups)
    group_score_TxG = jnp.sum(jax.lax.top_k(per_group_TxGxEg, 2)[0], axis=-1)
    _, best_TxGk = jax.lax.top_k(group_score_TxG, kept)
    kept_TxG = jnp.any(best_TxGk[:, :, None] == jnp.arange(groups), axis=1)
    return jnp.where(jnp.repeat(kept_TxG, E // groups, axis=1), selection_TxE, -jnp.inf)


def expert_counts(expert_TxK: jax.Array, num_experts: int) -> jax.Array:
    """Requested (pre-drop) assignments per expert, int32 [E]."""
    return jnp.zeros((num_experts,), jnp.int32).at[expert_TxK.reshape(-1)].add(1)


def balance_loss(routing: Routing, num_groups: int = 1, total=None) -> jax.Array:
    """Switch load-balancing loss E * sum_i f_i * P_i, averaged over token groups.

    f_i: share of the group's token copies routed to expert i (hard counts);
    P_i: mean normalised score of expert i over the group's tokens. Groups are
    contiguous token blocks: one per device micro-batch, per sequence, or one
    for the whole batch (the scope). 1.0 when routing is uniform. `total` sums a
    statistic over the devices that share the one group (a psum inside a
    per-device program); None when this call holds the group's every token.
    """
    T, E = routing.probs_TxE.shape
    G = num_groups
    expert_GxN = routing.expert_TxK.reshape(G, -1)
    counts_GxE = jnp.zeros((G, E), jnp.float32).at[
        jnp.arange(G)[:, None], expert_GxN].add(1.0)
    prob_sum_GxE = jnp.sum(routing.probs_TxE.reshape(G, T // G, E), axis=1)
    copies, tokens = jnp.float32(expert_GxN.shape[1]), jnp.float32(T // G)
    if total is not None:
        counts_GxE, prob_sum_GxE, copies, tokens = (
            total(counts_GxE), total(prob_sum_GxE), total(copies), total(tokens))
    return E * jnp.mean(jnp.sum((counts_GxE / copies) * (prob_sum_GxE / tokens), axis=-1))


def z_loss(routing: Routing) -> jax.Array:
    """Router z-loss: mean squared log-partition of the logits."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits_TxE, axis=-1)))


class Router(nnx.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, std: float, rngs: nnx.Rngs):
        self.w = param(rngs, (d_model, cfg.num_experts), ("embed", "experts_replicated"), std)
        if cfg.expert_bias:
            self.bias = ExpertBias(jnp.zeros((cfg.num_experts,), jnp.float32),
                                   out_sharding=("experts_replicated",), eager_sharding=False)
        self.cfg = cfg

    @jax.named_scope("router")
    def __call__(self, x_TxD: jax.Array, jitter_key: jax.Array | None = None) -> Routing:
        x = x_TxD.astype(jnp.float32)
        if jitter_key is not None and self.cfg.router_jitter > 0:
            eps = self.cfg.router_jitter
            x = x * jax.random.uniform(jitter_key, x.shape, jnp.float32, 1.0 - eps, 1.0 + eps)
        logits_TxE = checkpoint_name(x @ self.w[...], ROUTER_LOGITS)
        bias = self.bias[...] if self.cfg.expert_bias else None
        return route(logits_TxE, self.cfg, bias)


def update_expert_bias(buffers: nnx.State, counts_LxE: jax.Array, rate: float,
                       place: Callable = lambda delta: delta, mtp_layers: int = 0) -> nnx.State:
    """Aux-loss-free balancing: nudge each expert's selection bias toward mean load.

    Uses the step's requested counts summed over the global batch, in model order
    (the MoE layers', then the `mtp_layers` multi-token prediction modules'), once per
    optimizer step, however often a layer was recomputed. `place` puts the MoE
    layers' updates where `buffers` hold their layers (a program's `own_layers`: a
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
