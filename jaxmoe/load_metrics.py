"""Honest expert-load metrics, and a detector for token gerrymandering.

The Switch loss E * sum_i f_i P_i equals 1 + E * sum_i (f_i - 1/E)(P_i - 1/E):
one plus a covariance of hard loads f and soft scores P, not a distance from
uniform load. It can fall while the real load gets worse, when popular experts
win tokens by small margins and experts nobody picks soak up score mass. So the
load is reported directly, from requested (pre-drop) counts over the global batch.
"""

from __future__ import annotations

import jax.numpy as jnp


def load_metrics(aux: dict, num_tokens: int, top_k: int, ep_size: int,
                 balance_weight: float) -> dict:
    """Per MoE layer ([L] arrays) from step-summed router stats (see MoE.__call__).

    aux arrays are sums over the global batch: counts_E [L, E], prob_sum_E [L, E],
    margin_sum [L], dropped [L]; balance_loss [L] is the scoped training loss.
    """
    counts_LxE = aux["counts_E"].astype(jnp.float32)
    L, E = counts_LxE.shape
    mean_load = jnp.maximum(jnp.mean(counts_LxE, -1), 1e-9)
    f_LxE = counts_LxE / jnp.maximum(jnp.sum(counts_LxE, -1, keepdims=True), 1.0)
    P_LxE = aux["prob_sum_E"] / num_tokens
    rank_LxR = jnp.sum(counts_LxE.reshape(L, ep_size, E // ep_size), -1)
    dead_LxE = counts_LxE == 0
    entropy = -jnp.sum(jnp.where(f_LxE > 0, f_LxE * jnp.log(jnp.maximum(f_LxE, 1e-30)), 0.0), -1)
    return {
        "load_max_over_mean": jnp.max(counts_LxE, -1) / mean_load,
        "rank_load_max_over_mean": jnp.max(rank_LxR, -1) / jnp.maximum(jnp.mean(rank_LxR, -1), 1e-9),
        "dead_experts": jnp.sum(dead_LxE, -1).astype(jnp.int32),
        "drop_fraction": aux["dropped"].astype(jnp.float32) / (num_tokens * top_k),
        "entropy_deficit": jnp.log(E) - entropy,
        "balance_loss_layer": aux["balance_loss"],
        "balance_loss_scaled": balance_weight * aux["balance_loss"],
        # E^2 Cov(f, P) over the global batch: the part of the Switch loss above 1
        "balance_cov": E * jnp.sum((f_LxE - 1.0 / E) * (P_LxE - 1.0 / E), -1),
        "dead_score_mass": jnp.sum(jnp.where(dead_LxE, P_LxE, 0.0), -1),
        "topk_margin": aux["margin_sum"] / num_tokens,
        "expert_load": counts_LxE / mean_load[:, None],
    }


def gerrymandering(history: list[tuple[float, float]], window: int = 5,
                   min_change: float = 0.02) -> str | None:
    """Flags a balance loss that falls while the true max/mean load rises.

    history: (balance loss, worst layer's max/mean load) per logged step, oldest
    first. Compares the mean of the last `window` entries with the `window` before.
    """
    if len(history) < 2 * window:
        return None
    before, after = history[-2 * window:-window], history[-window:]
    loss0, load0 = (sum(x) / window for x in zip(*before))
    loss1, load1 = (sum(x) / window for x in zip(*after))
    if loss1 < loss0 * (1 - min_change) and load1 > load0 * (1 + min_change):
        return (f"gerrymandering: balance loss fell {loss0:.3f} -> {loss1:.3f} while "
                f"max/mean expert load rose {load0:.2f} -> {load1:.2f}")
    return None
