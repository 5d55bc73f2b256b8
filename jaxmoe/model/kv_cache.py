"""Decoding with a KV cache: prefill a prompt, then feed one token at a time.

The cache holds every layer's rotated keys and values in Lc slots, a static
maximum length, so decoding compiles once per (batch, Lc). A query at position p
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

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import Config
from jaxmoe.model.transformer import Block, Transformer

Cache = dict[str, tuple[jax.Array, jax.Array]]  # stack name -> (k, v) [Ls, B, Lc, G, Hd]


def init_cache(cfg: Config, batch: int, slots: int) -> Cache:
    m = cfg.model
    stacks = {"dense_layers": m.num_dense_layers, "moe_layers": cfg.num_moe_layers}
    dtype = jnp.dtype(m.compute_dtype)
    return {name: (jnp.zeros((n, batch, slots, m.num_kv_heads, m.head_size), dtype),) * 2
            for name, n in stacks.items() if n}


def _block(block: Block, x_BxLxD, positions_BxL, k_BxLcxGxHd, v_BxLcxGxHd, start, first_B):
    q, k_new, v_new = block.attn.qkv(block.attn_norm(x_BxLxD), positions_BxL)
    k_BxLcxGxHd = jax.lax.dynamic_update_slice_in_dim(k_BxLcxGxHd, k_new, start, axis=1)
    v_BxLcxGxHd = jax.lax.dynamic_update_slice_in_dim(v_BxLcxGxHd, v_new, start, axis=1)
    slots_Lc = jnp.arange(k_BxLcxGxHd.shape[1])
    causal_BxLxLc = positions_BxL[:, :, None] >= slots_Lc
    real_BxLxLc = (slots_Lc >= first_B[:, None, None]) | (positions_BxL[:, :, None] == slots_Lc)
    mask_Bx1xLxLc = (causal_BxLxLc & real_BxLxLc)[:, None]
    o = jax.nn.dot_product_attention(q, k_BxLcxGxHd, v_BxLcxGxHd, mask=mask_Bx1xLxLc)
    x_BxLxD, aux = block.feed_forward(x_BxLxD + block.attn.out(o))
    return x_BxLxD, k_BxLcxGxHd, v_BxLcxGxHd, aux


def forward(model: Transformer, tokens_BxL: jax.Array, cache: Cache, start: jax.Array | int,
            first_B: jax.Array | None = None) -> tuple[jax.Array, Cache, dict]:
    """Logits [B, L, V] for tokens at positions start..start+L-1, the cache with
    their keys and values written, and the MoE layers' aux (as `Transformer`).
    first_B: each row's first real slot (left padding before it); None: 0."""
    B, L = tokens_BxL.shape
    first_B = jnp.zeros(B, jnp.int32) if first_B is None else first_B
    positions_BxL = start + jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    x = model.embed[...][tokens_BxL].astype(jnp.dtype(model.cfg.model.compute_dtype))
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
