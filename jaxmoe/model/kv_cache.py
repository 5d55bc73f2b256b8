"""Decoding with a KV cache: prefill a prompt, then feed one token at a time.

The cache holds what every layer's attention keeps of each token (its rotated keys
and values; with `model.attention: mla`, its latent and rotated RoPE key, from which
each call expands the heads' keys and values) in Lc slots, a static maximum length,
so decoding compiles once per (batch, Lc). A query at position p
attends to the slots 0..p; slots not yet written are masked out. `forward` runs
the same blocks as `Transformer.__call__` with causal attention over the cache
instead of over the call's own tokens.

Prompts of different lengths are left-padded: row b's real tokens start at slot
first_B[b], and no query attends to the padding before it (a padding query
attends to itself only, so every softmax row has a finite entry).

Shapes: B batch, L tokens of this call, Lc cache slots, G kv heads, Hd head size,
Ls layers of one stack.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import ModelConfig
from jaxmoe.model.attention import narrow_values, softmax_scale
from jaxmoe.model.transformer import Block, Transformer, attention_class

# stack name -> what attention keeps per token, [Ls, B, Lc, ...] each: (k, v) of
# [G, Hd] per token, or MLA's (latent [Rkv], RoPE key [Hr])
Cache = dict[str, tuple[jax.Array, jax.Array]]


def init_cache(m: ModelConfig, batch: int, slots: int) -> Cache:
    stacks = {"dense_layers": m.num_dense_layers, "moe_layers": m.num_moe_layers}
    dtype = jnp.dtype(m.compute_dtype)
    shapes = attention_class(m).cache_shapes(m)
    return {name: tuple(jnp.zeros((n, batch, slots, *shape), dtype) for shape in shapes)
            for name, n in stacks.items() if n}


def cache_numbers_per_token(m: ModelConfig) -> int:
    """Numbers the cache keeps per token and layer (x layers: the whole cache's)."""
    return sum(math.prod(shape) for shape in attention_class(m).cache_shapes(m))


def _block(block: Block, x_BxLxD, positions_BxL, kept_a, kept_b, start, first_B):
    q, (new_a, new_b) = block.attn.cached(block.attn_norm(x_BxLxD), positions_BxL)
    kept_a = jax.lax.dynamic_update_slice_in_dim(kept_a, new_a.astype(kept_a.dtype), start, axis=1)
    kept_b = jax.lax.dynamic_update_slice_in_dim(kept_b, new_b.astype(kept_b.dtype), start, axis=1)
    k_BxLcxGxHd, v_BxLcxGxHd = block.attn.keys_values(kept_a, kept_b)
    slots_Lc = jnp.arange(k_BxLcxGxHd.shape[1])
    causal_BxLxLc = positions_BxL[:, :, None] >= slots_Lc
    real_BxLxLc = (slots_Lc >= first_B[:, None, None]) | (positions_BxL[:, :, None] == slots_Lc)
    mask_Bx1xLxLc = (causal_BxLxLc & real_BxLxLc)[:, None]
    o = narrow_values(jax.nn.dot_product_attention)(
        q, k_BxLcxGxHd, v_BxLcxGxHd, mask=mask_Bx1xLxLc, scale=softmax_scale(block.attn.cfg))
    x_BxLxD, aux = block.feed_forward(x_BxLxD + block.attn.out(o))
    return x_BxLxD, kept_a, kept_b, aux


def forward(model: Transformer, tokens_BxL: jax.Array, cache: Cache, start: jax.Array | int,
            first_B: jax.Array | None = None) -> tuple[jax.Array, Cache, dict]:
    """Logits [B, L, V] for tokens at positions start..start+L-1, the cache with
    their keys and values written, and the MoE layers' aux (as `Transformer`).
    first_B: each row's first real slot (left padding before it); None: 0."""
    B, L = tokens_BxL.shape
    first_B = jnp.zeros(B, jnp.int32) if first_B is None else first_B
    positions_BxL = start + jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    x = model.embed[...][tokens_BxL].astype(jnp.dtype(model.model_cfg.compute_dtype))
    new_cache, aux = {}, {}
    for name, (k, v) in cache.items():
        if name == "moe_layers":
            graphdef, state = model.moe_stack()
        else:
            graphdef, state = nnx.split(model.dense_layers)

        def body(x, layer):
            layer_state, k, v = layer
            x, k, v, layer_aux = _block(nnx.merge(graphdef, layer_state), x, positions_BxL, k, v,
                                        start, first_B)
            return x, (k, v, layer_aux)

        x, (k, v, layer_aux) = jax.lax.scan(body, x, (state, k, v))
        new_cache[name] = (k, v)
        if name == "moe_layers":
            aux = layer_aux
    return model.logits(x), new_cache, aux
