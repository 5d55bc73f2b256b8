"""The MoE feed-forward: router -> dispatch -> experts -> combine (+ shared expert)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxmoe.config import MoEConfig
from jaxmoe.model.dispatch import Dispatched, get_dispatcher
from jaxmoe.model.experts import Experts
from jaxmoe.model.layers import MLP
from jaxmoe.model.router import Router, balance_loss, expert_counts, z_loss
from jaxmoe.sharding import BATCH_AXES

LOCAL_DISPATCHERS = ("dense", "grouped")


def _dispatch(x_TxD, routing, weights, cfg: MoEConfig, mesh: Mesh | None):
    """Local dispatchers run per batch shard (each device packs its own tokens);
    the expert-parallel ones place themselves on the mesh."""
    dispatcher = get_dispatcher(cfg.dispatcher)
    if cfg.dispatcher not in LOCAL_DISPATCHERS:
        return dispatcher(x_TxD, routing, weights, cfg, mesh)
    if mesh is None or mesh.shape["data"] * mesh.shape["expert"] == 1:
        # one batch shard: a shard_map would only wrap the expert weights and their
        # gradients in copies at every layer
        return dispatcher(x_TxD, routing, weights, cfg, None)

    def local(x, r, w):
        out = dispatcher(x, r, w, cfg, None)
        return out._replace(dropped=jax.lax.psum(out.dropped, BATCH_AXES))

    return jax.shard_map(local, mesh=mesh, in_specs=(P(BATCH_AXES), P(BATCH_AXES), P()),
                         out_specs=Dispatched(P(BATCH_AXES), P()))(x_TxD, routing, weights)


class MoE(nnx.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, std: float, out_std: float, rngs: nnx.Rngs):
        self.router = Router(d_model, cfg, std, rngs)
        self.experts = Experts(cfg.num_experts, d_model, cfg.expert_hidden, std, out_std, rngs)
        if cfg.shared_expert_hidden:
            self.shared = MLP(d_model, cfg.shared_expert_hidden, std, out_std, rngs)
        self.cfg = cfg

    def __call__(self, x_BxLxD: jax.Array, mesh: Mesh | None = None,
                 jitter_key: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Returns the layer output and its router statistics (losses unscaled).

        aux: balance_loss (at the configured scope), z_loss, and sums over this
        call's tokens for the load metrics: counts_E (requested copies per expert,
        before any drop), dropped (copies that found no buffer room), prob_sum_E
        (normalised scores) and margin_sum (k-th minus (k+1)-th score).
        """
        cfg = self.cfg
        B, L, D = x_BxLxD.shape
        x_TxD = x_BxLxD.reshape(B * L, D)
        routing = self.router(x_TxD, jitter_key)
        counts_E = expert_counts(routing.expert_TxK, cfg.num_experts)
        out = _dispatch(x_TxD, routing, self.experts.weights(), cfg, mesh)
        y_TxD = out.y_TxD
        if cfg.shared_expert_hidden:
            y_TxD = y_TxD + self.shared(x_TxD)
        aux = {
            "balance_loss": balance_loss(routing, self._balance_groups(B, mesh)),
            "z_loss": z_loss(routing),
            "counts_E": counts_E,
            "dropped": out.dropped,
            "prob_sum_E": jnp.sum(jax.lax.stop_gradient(routing.probs_TxE), axis=0),
            "margin_sum": jnp.sum(routing.margin_T),
        }
        return y_TxD.reshape(B, L, D).astype(x_BxLxD.dtype), aux

    def _balance_groups(self, batch: int, mesh: Mesh | None) -> int:
        scope = self.cfg.balance_scope
        if scope == "sequence":
            return batch
        if scope == "microbatch" and mesh is not None:
            return mesh.shape["data"] * mesh.shape["expert"]  # one per device's batch shard
        return 1
