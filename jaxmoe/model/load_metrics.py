"""Honest expert-load metrics, computed in the step from the router's statistics.

The Switch loss E * sum_i f_i P_i equals 1 + E * sum_i (f_i - 1/E)(P_i - 1/E):
one plus a covariance of hard loads f and soft scores P, not a distance from
uniform load. It can fall while the real load gets worse, when popular experts
win tokens by small margins and experts nobody picks soak up score mass, and sit
at 1 while most experts lie dead. So the load is reported directly, from
requested (pre-drop) counts over the global batch; `jaxmoe.observe.gerrymandering`
compares the loss with it over a run.
"""

from __future__ import annotations

import jax.numpy as jnp


def load_metrics(aux: dict, num_tokens: int, top_k: int, ep_size: int,
                 balance_weight: float) -> dict:
    """Per MoE layer ([Lm] arrays) from step-summed router stats (see MoE.__call__).

    aux arrays are sums over the global batch: counts [Lm, E], prob_sums [Lm, E],
    margin_sum [Lm], dropped [Lm]; balance_loss [Lm] is the scoped training loss.
    """
    counts_LmxE = aux["counts"].astype(jnp.float32)
    Lm, E = counts_LmxE.shape
    mean_load = jnp.maximum(jnp.mean(counts_LmxE, -1), 1e-9)
    f_LmxE = counts_LmxE / jnp.maximum(jnp.sum(counts_LmxE, -1, keepdims=True), 1.0)
    P_LmxE = aux["prob_sums"] / num_tokens
    rank_LmxR = jnp.sum(counts_LmxE.reshape(Lm, ep_size, E // ep_size), -1)
    dead_LmxE = counts_LmxE == 0
    entropy = -jnp.sum(jnp.where(f_LmxE > 0, f_LmxE * jnp.log(jnp.maximum(f_LmxE, 1e-30)), 0.0), -1)
    return {
        "load_max_over_mean": jnp.max(counts_LmxE, -1) / mean_load,
        "rank_load_max_over_mean": jnp.max(rank_LmxR, -1) / jnp.maximum(jnp.mean(rank_LmxR, -1), 1e-9),
        "dead_experts": jnp.sum(dead_LmxE, -1).astype(jnp.int32),
        "drop_fraction": aux["dropped"].astype(jnp.float32) / (num_tokens * top_k),
        "entropy_deficit": jnp.log(E) - entropy,
        "balance_loss_layer": aux["balance_loss"],
        "balance_loss_scaled": balance_weight * aux["balance_loss"],
        # E^2 Cov(f, P) over the global batch: the part of the Switch loss above 1
        "balance_cov": E * jnp.sum((f_LmxE - 1.0 / E) * (P_LmxE - 1.0 / E), -1),
        "dead_score_mass": jnp.sum(jnp.where(dead_LmxE, P_LmxE, 0.0), -1),
        "topk_margin": aux["margin_sum"] / num_tokens,
        "expert_load": counts_LmxE / mean_load[:, None],
    }
