"""Decoder-only MoE transformer with layers stacked and scanned.

Layers of one kind share a stack whose parameters carry a leading `layers`
axis; `lax.scan` runs the stack, so compile time does not grow with depth.
The first `num_dense_layers` layers form a dense-MLP stack, the rest a MoE stack.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxmoe.config import Config
from jaxmoe.sharding import constrain_batch
from jaxmoe.model.attention import Attention
from jaxmoe.model.layers import MLP, RMSNorm, param
from jaxmoe.model.moe import MoE
from jaxmoe.parallel.pipeline import pipeline, stored_layer_order

REMAT_POLICIES = {
    "full": None,  # recompute the whole layer in the backward pass
    "matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def init_stds(cfg: Config) -> tuple[float, float]:
    """Init std of a block's input projections, and of its output projections (scaled
    down with depth, so the residual stream's variance stays put)."""
    return cfg.model.init_std, cfg.model.init_std / math.sqrt(2 * cfg.model.num_layers)


class Block(nnx.Module):
    def __init__(self, cfg: Config, use_moe: bool, rngs: nnx.Rngs):
        std, out_std = init_stds(cfg)
        m = cfg.model
        self.attn_norm = RMSNorm(m.d_model, m.norm_eps, "embed", rngs)
        self.attn = Attention(m, out_std, rngs)
        self.mlp_norm = RMSNorm(m.d_model, m.norm_eps, "embed", rngs)
        if use_moe:
            self.moe = MoE(m.d_model, cfg.moe, std, out_std, rngs)
        else:
            self.mlp = MLP(m.d_model, m.mlp_hidden, std, out_std, rngs)
        self.use_moe = use_moe

    def __call__(self, x_BxLxD, positions_BxL, mesh=None, jitter_key=None):
        x_BxLxD = constrain_batch(x_BxLxD, mesh)
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), positions_BxL)
        x_BxLxD, aux = self.feed_forward(x_BxLxD, mesh, jitter_key)
        return constrain_batch(x_BxLxD, mesh), aux

    def feed_forward(self, x_BxLxD, mesh=None, jitter_key=None):
        """The block's second half, shared with KV-cache decoding: x + MLP or MoE of
        norm(x), and the MoE's aux ({} for a dense layer)."""
        h = self.mlp_norm(x_BxLxD)
        if self.use_moe:
            y, aux = self.moe(h, mesh, jitter_key)
        else:
            y, aux = self.mlp(h), {}
        return x_BxLxD + y, aux


def _stack(cfg: Config, use_moe: bool, n: int, rngs: nnx.Rngs) -> Block:
    # MoE layers are what pipeline stages split ("layers" -> stage); the few dense
    # layers in front run replicated, like the embedding.
    axis = "layers" if use_moe else "dense_layers"

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(rngs):
        return Block(cfg, use_moe, rngs)

    return make(rngs)


def run_stack(stack: Block, x_BxLxD, positions_BxL, mesh, key, remat: str):
    """Scans the stacked blocks over x; returns x and the per-layer aux, stacked."""
    graphdef, state = nnx.split(stack)
    return scan_layers(graphdef, state, x_BxLxD, positions_BxL, mesh, key, remat)


def scan_layers(graphdef, state, x_BxLxD, positions_BxL, mesh, key, remat: str, active_N=None):
    """lax.scan of one block over stacked layer states (leading axis = layers).

    active_N: per-layer flags; an inactive layer passes x through and reports zeros.
    """
    n = jax.tree.leaves(state)[0].shape[0]
    keys = None if key is None else jax.random.split(key, n)

    def body(x, layer):
        layer_state, k, active = layer
        y, aux = nnx.merge(graphdef, layer_state)(x, positions_BxL, mesh, k)
        if active is None:
            return y, aux
        return jnp.where(active, y, x), jax.tree.map(lambda a: jnp.where(active, a, 0), aux)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return jax.lax.scan(body, x_BxLxD, (state, keys, active_N))


class Transformer(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        m = cfg.model
        self.embed = param(rngs, (m.vocab_size, m.d_model), ("vocab", "embed"), m.init_std)
        if m.num_dense_layers:
            self.dense_layers = _stack(cfg, False, m.num_dense_layers, rngs)
        if cfg.num_moe_layers:
            self.moe_layers = _stack(cfg, True, cfg.moe_layer_slots, rngs)
        self.final_norm = RMSNorm(m.d_model, m.norm_eps, "embed", rngs)
        self.head = param(rngs, (m.d_model, m.vocab_size), ("embed", "vocab"), m.init_std)
        self.cfg = cfg

    def __call__(self, tokens_BxL: jax.Array, *, mesh: Mesh | None = None,
                 key: jax.Array | None = None, remat: str = "none") -> tuple[jax.Array, dict]:
        """Returns fp32 logits [B, L, V] and aux: per MoE layer router stats, stacked.

        `key` enables training-time randomness (router jitter); `mesh` is needed
        by the expert-parallel dispatchers only.
        """
        x_BxLxD, aux = self.hidden(tokens_BxL, mesh=mesh, key=key, remat=remat)
        return self.logits(x_BxLxD, mesh), aux

    def hidden(self, tokens_BxL: jax.Array, *, mesh: Mesh | None = None,
               key: jax.Array | None = None, remat: str = "none") -> tuple[jax.Array, dict]:
        """The last block's output [B, L, D] (before the final norm) and aux."""
        m = self.cfg.model
        B, L = tokens_BxL.shape
        positions_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
        x = self.embed[...][tokens_BxL].astype(jnp.dtype(m.compute_dtype))
        x = constrain_batch(x, mesh)
        aux = {}
        if m.num_dense_layers:
            x, _ = run_stack(self.dense_layers, x, positions_BxL, mesh, None, remat)
        pipe = self.cfg.pipeline
        if self.cfg.num_moe_layers and mesh is not None and mesh.shape["stage"] > 1:
            x, aux = pipeline(self.moe_layers, x, positions_BxL, mesh, key, remat,
                              pipe.microbatches, pipe.virtual_stages, self.cfg.num_moe_layers)
        elif self.cfg.num_moe_layers:
            graphdef, state = self.moe_stack()
            x, aux = scan_layers(graphdef, state, x, positions_BxL, mesh, key, remat)
        return x, aux

    def moe_stack(self) -> tuple[nnx.GraphDef, nnx.State]:
        """The MoE layers' graphdef and stacked state, in model order."""
        graphdef, state = nnx.split(self.moe_layers)
        order, Lm = stored_layer_order(self.cfg), self.cfg.num_moe_layers
        if not np.array_equal(order, np.arange(Lm)):  # stored for a pipeline, maybe padded
            state = jax.tree.map(lambda a: a[np.argsort(order)[:Lm]], state)
        return graphdef, state

    def logits(self, x_BxLxD: jax.Array, mesh: Mesh | None = None) -> jax.Array:
        """Final norm and LM head: fp32 logits [B, L, V]."""
        x_BxLxD = self.final_norm(x_BxLxD)
        logits = jnp.einsum("bld,dv->blv", x_BxLxD, self.head[...].astype(x_BxLxD.dtype))
        return constrain_batch(logits, mesh).astype(jnp.float32)

    def cross_entropy(self, x_BxLxD: jax.Array, targets_BxL: jax.Array, mesh: Mesh | None = None,
                      chunk: int = 0) -> jax.Array:
        """Mean next-token cross-entropy from `hidden`'s output. chunk > 0: the head
        runs `chunk` positions at a time, recomputed in the backward pass, so only
        [B, chunk, V] logits exist at once."""
        B, L, D = x_BxLxD.shape
        if not chunk or chunk >= L:
            logits = self.logits(x_BxLxD, mesh)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxL).mean()

        @jax.checkpoint
        def chunk_ce(total, xs):
            x_BxCxD, targets_BxC = xs
            logits = self.logits(x_BxCxD, mesh)
            return total + optax.softmax_cross_entropy_with_integer_labels(
                logits, targets_BxC).sum(), None

        n = L // chunk
        xs = (x_BxLxD.reshape(B, n, chunk, D).swapaxes(0, 1),
              targets_BxL.reshape(B, n, chunk).swapaxes(0, 1))
        total, _ = jax.lax.scan(chunk_ce, jnp.zeros((), jnp.float32), xs)
        return total / (B * L)
