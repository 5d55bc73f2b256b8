"""Causal grouped-query attention with RoPE and optional QK-norm (per head or over the
whole projection)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config import ModelConfig
from jaxmoe.model.blockwise_attention import blockwise_attention
from jaxmoe.model.layers import param, project, rms_norm, rope, rope_frequencies, yarn_mscale
from jaxmoe.model.layout import LOCAL_LAYOUT, LocalLayout
from jaxmoe.model.remat import ATTENTION_OUT, ATTENTION_QKV

# aux: each head's largest attention logit in a layer, [layers, H] (`max_logits`)
MAX_LOGIT = "max_logit"
# aux entries combined by their maximum over micro-batches, stages and devices (the
# rest are summed)
MAX_STATS = (MAX_LOGIT,)


def unmeasured(key: str, like: jax.Array) -> jax.Array:
    """What aux entry `key` holds where nothing was measured (a pipeline's idle slot):
    -inf for a maximum, 0 for a sum."""
    return jnp.full_like(like, -jnp.inf if key in MAX_STATS else 0)


def combined(key: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """Two measurements of aux entry `key` as one: their maximum or their sum."""
    return jnp.maximum(a, b) if key in MAX_STATS else a + b


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, out_std: float, rngs: nnx.Rngs):
        D, H, G, Hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        std = cfg.init_std
        self.w_q = param(rngs, (D, H, Hd), ("embed", "heads", "head_dim"), std)
        self.w_k = param(rngs, (D, G, Hd), ("embed", "kv_heads", "head_dim"), std)
        self.w_v = param(rngs, (D, G, Hd), ("embed", "kv_heads", "head_dim"), std)
        self.w_o = param(rngs, (H, Hd, D), ("heads", "head_dim", "embed"), out_std)
        if cfg.qk_norm == "head":
            self.q_norm = param(rngs, (Hd,), ("head_dim",), value=1.0)
            self.k_norm = param(rngs, (Hd,), ("head_dim",), value=1.0)
        elif cfg.qk_norm == "full":  # one scale per element of the H x Hd projection
            self.q_norm = param(rngs, (H, Hd), ("heads", "head_dim"), value=1.0)
            self.k_norm = param(rngs, (G, Hd), ("kv_heads", "head_dim"), value=1.0)
        self.cfg = cfg

    def qkv(self, x_BxLxD: jax.Array, positions_BxL: jax.Array):
        cfg = self.cfg
        # named before QK-norm and RoPE: their backward needs these inputs, and
        # recomputing the elementwise ops from them is cheap
        q = checkpoint_name(project("bld,dhk->blhk", x_BxLxD, self.w_q.get_value()),
                            ATTENTION_QKV)
        k = checkpoint_name(project("bld,dgk->blgk", x_BxLxD, self.w_k.get_value()),
                            ATTENTION_QKV)
        v = checkpoint_name(project("bld,dgk->blgk", x_BxLxD, self.w_v.get_value()),
                            ATTENTION_QKV)
        if cfg.qk_norm != "none":
            axis = -1 if cfg.qk_norm == "head" else (-2, -1)
            q = rms_norm(q, self.q_norm[...], cfg.norm_eps, axis)
            k = rms_norm(k, self.k_norm[...], cfg.norm_eps, axis)
        return rotate(q, positions_BxL, cfg), rotate(k, positions_BxL, cfg), v

    def cached(self, x_BxLxD: jax.Array, positions_BxL: jax.Array):
        """(queries, what a decoder keeps of these tokens for later queries): their rotated
        keys and values, [B, L, G, Hd] each (`jaxmoe.model.kv_cache`)."""
        q, k, v = self.qkv(x_BxLxD, positions_BxL)
        return q, (k, v)

    @staticmethod
    def keys_values(k_BxLcxGxHd: jax.Array, v_BxLcxGxHd: jax.Array):
        """Keys and values from what `cached` kept: themselves."""
        return k_BxLcxGxHd, v_BxLcxGxHd

    @staticmethod
    def cache_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
        """Per token, the shapes of what `cached` keeps."""
        return (cfg.num_kv_heads, cfg.head_size), (cfg.num_kv_heads, cfg.value_size)

    def out(self, o_BxLxHxHd: jax.Array) -> jax.Array:
        return project("blhk,hkd->bld", o_BxLxHxHd, self.w_o.get_value())

    def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array,
                 layout: LocalLayout = LOCAL_LAYOUT, with_max_logits: bool = False):
        """layout: where the call runs; its kernels pick the attention (cuDNN's, XLA's
        or blockwise: `Kernels.attention`), and it reaches the rest of each sequence
        where the call holds a chunk of positions (`LocalLayout.attend`).
        with_max_logits: (output, each head's largest logit [H]) rather than the output."""
        return attend(self, x_BxLxD, positions_BxL, layout, with_max_logits)


def attend(module, x_BxLxD: jax.Array, positions_BxL: jax.Array, layout: LocalLayout,
           with_max_logits: bool):
    """An attention module's call (its `qkv`, the causal attention, its `out`)."""
    with jax.named_scope("attention"):
        q, k, v = module.qkv(x_BxLxD, positions_BxL)
        o = layout.attend(causal_attention(module.cfg, layout, with_max_logits), q, k, v)
        if with_max_logits:
            o, max_H = o
            return module.out(checkpoint_name(o, ATTENTION_OUT)), max_H
        return module.out(checkpoint_name(o, ATTENTION_OUT))


def rotate(x_BxLxHxHd: jax.Array, positions_BxL: jax.Array, cfg: ModelConfig) -> jax.Array:
    """`cfg`'s RoPE (its frequencies, YaRN's stretch, its pair layout) of x's first
    `rotary_dims` dimensions per head."""
    inv_freq, scale = rope_frequencies(cfg)
    return rope(x_BxLxHxHd, positions_BxL, cfg.rope_theta, cfg.rotary_dims, inv_freq=inv_freq,
                scale=scale, interleave=cfg.rope_interleave)


def causal_attention(cfg: ModelConfig, layout: LocalLayout, with_max_logits: bool = False):
    """attention(q, k, v) -> o: causal over whole sequences, at `cfg`'s softmax scale,
    in the kernel `layout`'s devices run (cuDNN's, XLA's or blockwise).
    with_max_logits: -> (o, `max_logits` of q and k)."""
    impl, scale = layout.kernels.attention(cfg), softmax_scale(cfg)

    @narrow_values
    def attention(q, k, v):
        if impl == "blockwise":
            return blockwise_attention(q, k, v, cfg.attention_block, scale)
        # both handle GQA (H a multiple of G)
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                            implementation=impl)

    if not with_max_logits:
        return attention
    return lambda q, k, v: (attention(q, k, v),
                            max_logits(q, k, scale, cfg.attention_block or MAX_LOGIT_BLOCK))


MAX_LOGIT_BLOCK = 512


def max_logits(q_BxLxHxHd: jax.Array, k_BxLxGxHd: jax.Array, scale: float,
               block: int = MAX_LOGIT_BLOCK) -> jax.Array:
    """fp32 [H]: each head's largest causal logit, scale q_i . k_j over j <= i, every
    row and position (MuonClip's S_max; no fused kernel returns it). No gradient.

    The scores are taken in `block` x `block` tiles on or below the diagonal, one at
    a time (a static list of tile pairs: no B x H x L x L array, and the tiles above
    the diagonal are not computed), at the queries' and keys' precision with fp32
    sums, as the attention kernels take them."""
    q_BxLxHxHd, k_BxLxGxHd = lax.stop_gradient(q_BxLxHxHd), lax.stop_gradient(k_BxLxGxHd)
    B, L, H, Hd = q_BxLxHxHd.shape
    G = k_BxLxGxHd.shape[2]
    Lb = math.gcd(L, block)
    Lb = L if Lb < min(L, 64) else Lb  # no tile size divides L well: one tile
    Nb = L // Lb
    q_NbxBxLbxGxHgxHd = q_BxLxHxHd.reshape(B, Nb, Lb, G, H // G, Hd).swapaxes(0, 1)
    k_NbxBxLbxGxHd = k_BxLxGxHd.reshape(B, Nb, Lb, G, Hd).swapaxes(0, 1)
    below_LbxLb = jnp.arange(Lb)[:, None] >= jnp.arange(Lb)[None, :]
    rows, cols = np.tril_indices(Nb)

    def tile(max_GxHg, ij):
        i, j = ij
        s = jnp.einsum("bqgrk,bsgk->bgrqs", q_NbxBxLbxGxHgxHd[i], k_NbxBxLbxGxHd[j],
                       preferred_element_type=jnp.float32)
        s = jnp.where((i != j) | below_LbxLb, s, -jnp.inf)
        return jnp.maximum(max_GxHg, jnp.max(s, axis=(0, 3, 4))), None

    # like q, so that inside a per-device program it varies over the same axes
    init = jnp.full_like(q_BxLxHxHd, -jnp.inf, shape=(G, H // G), dtype=jnp.float32)
    max_GxHg, _ = lax.scan(tile, init, (jnp.asarray(rows), jnp.asarray(cols)))
    return max_GxHg.reshape(H) * scale


def narrow_values(attention):
    """`attention(q, k, v, ...)` taking values narrower than the queries and keys (MLA's):
    they are zero-padded to their width (the kernels take one head size), which changes
    nothing of the output's first columns, and those are kept."""
    def attend(q, k, v, **kwargs):
        Hv = v.shape[-1]
        if Hv == q.shape[-1]:
            return attention(q, k, v, **kwargs)
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, q.shape[-1] - Hv)])
        return attention(q, k, v, **kwargs)[..., :Hv]

    return attend


def softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(query size), times YaRN's mscale(factor, yarn_mscale_all_dim)^2 where it
    stretches RoPE with yarn_mscale_all_dim set (DeepSeek-V3's rule)."""
    scale = cfg.head_size ** -0.5
    if cfg.yarn_factor and cfg.yarn_mscale_all_dim:
        scale *= yarn_mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim) ** 2
    return scale
