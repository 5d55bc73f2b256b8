"""Causal attention in blocks with an online softmax (the flash-attention recurrence).

Queries are taken N at a time; for each query block a scan visits the key blocks,
keeping the running max m, normaliser l and output o, so no more than an
N x N block of scores exists at once, and both loops are recomputed in the
backward pass. Blocks entirely above the diagonal are masked, not skipped (the
scan has a static length), so this costs up to twice the score FLOPs of a fused
kernel: it is for memory, on backends without one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite: a fully masked block must not turn the running max into -inf


def blockwise_attention(q_BxLxHxK: jax.Array, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array,
                        block: int) -> jax.Array:
    """Causal grouped-query attention; H a multiple of G, L a multiple of `block`."""
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxLxGxK.shape[2]
    N, R = L // block, H // G
    q_NxBxCxGxRxK = (q_BxLxHxK.astype(jnp.float32) * K ** -0.5).reshape(
        B, N, block, G, R, K).swapaxes(0, 1)
    k_NxBxCxGxK = k_BxLxGxK.reshape(B, N, block, G, K).swapaxes(0, 1)
    v_NxBxCxGxK = v_BxLxGxK.reshape(B, N, block, G, K).swapaxes(0, 1)
    rows_C = jnp.arange(block)

    def query_block(args):
        i, q = args

        def key_block(carry, kv):
            o, m, l = carry
            j, k, v = kv
            s = jnp.einsum("bqgrk,bsgk->bgrqs", q, k, preferred_element_type=jnp.float32)
            visible_CxC = (i * block + rows_C)[:, None] >= (j * block + rows_C)[None, :]
            s = jnp.where(visible_CxC, s, _MASKED)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m - m_new)
            l = l * correction + jnp.sum(p, axis=-1)
            o = o * correction[..., None] + jnp.einsum("bgrqs,bsgk->bgrqk", p, v.astype(jnp.float32))
            return (o, m_new, l), None

        # like q, so that inside a per-device program they vary over the same axes
        init = (jnp.zeros_like(q, shape=(B, G, R, block, K)),
                jnp.full_like(q, _MASKED, shape=(B, G, R, block)),
                jnp.zeros_like(q, shape=(B, G, R, block)))
        (o, _, l), _ = jax.lax.scan(jax.checkpoint(key_block), init,
                                    (jnp.arange(N), k_NxBxCxGxK, v_NxBxCxGxK))
        return (o / l[..., None]).transpose(0, 3, 1, 2, 4)  # [B, C, G, R, K]

    o_NxBxCxGxRxK = jax.lax.map(jax.checkpoint(query_block), (jnp.arange(N), q_NxBxCxGxRxK))
    return o_NxBxCxGxRxK.swapaxes(0, 1).reshape(B, L, H, K).astype(q_BxLxHxK.dtype)
