"""The MoE feed-forward: router -> dispatch -> experts -> combine (+ shared expert)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import MoEConfig
from jaxmoe.model.experts import Experts
from jaxmoe.model.layers import MLP
from jaxmoe.model.layout import LOCAL_LAYOUT, LocalLayout
from jaxmoe.model.router import Router, balance_loss, expert_counts, z_loss

# The router statistics that are means over a call's tokens (totalled over batch
# shards or micro-batches, they are averaged); the other aux entries are sums.
MEAN_STATS = ("balance_loss", "z_loss")


class MoE(nnx.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, std: float, out_std: float, rngs: nnx.Rngs):
        self.router = Router(d_model, cfg, std, rngs)
        self.experts = Experts(cfg.num_experts, d_model, cfg.expert_hidden, std, out_std, rngs)
        if cfg.shared_expert_hidden:
            self.shared = MLP(d_model, cfg.shared_expert_hidden, std, out_std, rngs)
        self.cfg = cfg

    def __call__(self, x_BxLxD: jax.Array, layout: LocalLayout = LOCAL_LAYOUT,
                 jitter_key: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Returns the layer output and its router statistics (losses unscaled).

        layout: where the layer runs (`jaxmoe.model.layout`; a mesh's in
        `jaxmoe.parallel.layout`); by default one device and the local dispatchers.

        aux: balance_loss (at the configured scope), z_loss, and sums over this
        call's tokens for the load metrics: counts (requested copies per expert,
        before any drop), dropped (copies that found no buffer room), prob_sums
        (normalised scores) and margin_sum (k-th minus (k+1)-th score).
        """
        cfg = self.cfg
        B, L, D = x_BxLxD.shape
        x_TxD = x_BxLxD.reshape(B * L, D)
        routing = self.router(x_TxD, jitter_key)
        counts_E = expert_counts(routing.expert_TxK, cfg.num_experts)
        with jax.named_scope("dispatch"):
            y_TxD, dropped = self._dispatch_in_chunks(x_TxD, routing, layout, (B, L))
        if cfg.shared_expert_hidden:
            with jax.named_scope("shared_expert"):
                y_TxD = y_TxD + self.shared(x_TxD)
        aux = {
            "balance_loss": self._balance_loss(routing, B, layout),
            "z_loss": z_loss(routing),
            "counts": counts_E,
            "dropped": dropped,
            "prob_sums": jnp.sum(jax.lax.stop_gradient(routing.probs_TxE), axis=0),
            "margin_sum": jnp.sum(routing.margin_T),
        }
        return y_TxD.reshape(B, L, D).astype(x_BxLxD.dtype), aux

    def _dispatch_in_chunks(self, x_TxD, routing, layout: LocalLayout, batch_shape):
        """The routed experts' output and the copies dropped, the tokens dispatched in
        `moe.exchange_chunks` chunks: separate exchanges and GEMMs with no data between
        them, which the compiler may run side by side (one chunk's exchange beside
        another's GEMMs, forward and backward)."""
        chunks, (B, L), T = self.cfg.exchange_chunks, batch_shape, x_TxD.shape[0]
        if T % chunks:
            raise ValueError(f"moe.exchange_chunks: {chunks} chunks do not divide the {T} "
                             f"tokens of a layer call ({B} rows x {L} positions a device)")
        Tc, weights = T // chunks, self.experts.weights()
        part = lambda a, i: a[i * Tc:(i + 1) * Tc]  # noqa: E731
        outs = [layout.dispatch(part(x_TxD, i),
                                jax.tree.map(lambda a: part(a, i), routing),  # noqa: B023
                                weights, self.cfg)
                for i in range(chunks)]
        if chunks == 1:
            return outs[0].y_TxD, outs[0].dropped
        return jnp.concatenate([o.y_TxD for o in outs]), sum(o.dropped for o in outs)

    def _balance_loss(self, routing, batch: int, layout: LocalLayout) -> jax.Array:
        # a sequence split over devices (`mesh.context`) is still one sequence, and a
        # device's batch shard is its rows' every position
        scope = self.cfg.balance_scope
        if scope == "sequence":
            return balance_loss(routing, batch, layout.sequence_total)
        if scope == "microbatch":  # one group per device's batch shard
            return balance_loss(routing, layout.batch_shards, layout.sequence_total)
        # the whole batch, whichever devices hold it
        return balance_loss(routing, 1, layout.batch_total)
