"""Causal attention in blocks with an online softmax (the flash-attention recurrence).

Queries are taken Lb at a time; for each query block a scan visits the key blocks,
keeping the running max m, normaliser l and output o, so no more than an
Lb x Lb block of scores exists at once, and both loops are recomputed in the
backward pass. Blocks entirely above the diagonal are masked, not skipped (the
scan has a static length), so this costs up to twice the score FLOPs of a fused
kernel: it is for memory, on backends without one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite: a fully masked block must not turn the running max into -inf


def blockwise_attention(q_BxLxHxHd: jax.Array, k_BxLxGxHd: jax.Array, v_BxLxGxHd: jax.Array,
                        block: int, scale: float | None = None) -> jax.Array:
    """Causal grouped-query attention; H a multiple of G, L a multiple of `block`;
    scores times `scale` (None: 1 / sqrt(Hd))."""
    B, L, H, Hd = q_BxLxHxHd.shape
    G = k_BxLxGxHd.shape[2]
    Nb, Hg = L // block, H // G
    scale = Hd ** -0.5 if scale is None else scale
    q_NbxBxLbxGxHgxHd = (q_BxLxHxHd.astype(jnp.float32) * scale).reshape(
        B, Nb, block, G, Hg, Hd).swapaxes(0, 1)
    k_NbxBxLbxGxHd = k_BxLxGxHd.reshape(B, Nb, block, G, Hd).swapaxes(0, 1)
    v_NbxBxLbxGxHd = v_BxLxGxHd.reshape(B, Nb, block, G, Hd).swapaxes(0, 1)
    rows_Lb = jnp.arange(block)

    def query_block(args):
        i, q = args

        def key_block(carry, kv):
            o, m, l = carry
            j, k, v = kv
            s = jnp.einsum("bqgrk,bsgk->bgrqs", q, k, preferred_element_type=jnp.float32)
            visible_LbxLb = (i * block + rows_Lb)[:, None] >= (j * block + rows_Lb)[None, :]
            s = jnp.where(visible_LbxLb, s, _MASKED)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m - m_new)
            l = l * correction + jnp.sum(p, axis=-1)
            o = o * correction[..., None] + jnp.einsum("bgrqs,bsgk->bgrqk", p, v.astype(jnp.float32))
            return (o, m_new, l), None

        # like q, so that inside a per-device program they vary over the same axes
        init = (jnp.zeros_like(q, shape=(B, G, Hg, block, Hd)),
                jnp.full_like(q, _MASKED, shape=(B, G, Hg, block)),
                jnp.zeros_like(q, shape=(B, G, Hg, block)))
        (o, _, l), _ = jax.lax.scan(jax.checkpoint(key_block), init,
                                    (jnp.arange(Nb), k_NbxBxLbxGxHd, v_NbxBxLbxGxHd))
        return (o / l[..., None]).transpose(0, 3, 1, 2, 4)  # [B, Lb, G, Hg, Hd]

    o_NbxBxLbxGxHgxHd = jax.lax.map(jax.checkpoint(query_block), (jnp.arange(Nb), q_NbxBxLbxGxHgxHd))
    return o_NbxBxLbxGxHgxHd.swapaxes(0, 1).reshape(B, L, H, Hd).astype(q_BxLxHxHd.dtype)
