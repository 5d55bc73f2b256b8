"""Causal grouped-query attention with RoPE and optional QK-norm (per head or over the
whole projection)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config import ModelConfig
from jaxmoe.model.blockwise_attention import blockwise_attention
from jaxmoe.model.layers import param, rms_norm, rope, rope_frequencies, yarn_mscale
from jaxmoe.model.layout import LOCAL_LAYOUT, LocalLayout
from jaxmoe.model.remat import ATTENTION_OUT, ATTENTION_QKV


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
        cfg, dt = self.cfg, x_BxLxD.dtype
        # named before QK-norm and RoPE: their backward needs these inputs, and
        # recomputing the elementwise ops from them is cheap
        q = checkpoint_name(jnp.einsum("bld,dhk->blhk", x_BxLxD, self.w_q[...].astype(dt)),
                            ATTENTION_QKV)
        k = checkpoint_name(jnp.einsum("bld,dgk->blgk", x_BxLxD, self.w_k[...].astype(dt)),
                            ATTENTION_QKV)
        v = checkpoint_name(jnp.einsum("bld,dgk->blgk", x_BxLxD, self.w_v[...].astype(dt)),
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
        return jnp.einsum("blhk,hkd->bld", o_BxLxHxHd, self.w_o[...].astype(o_BxLxHxHd.dtype))

    def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array,
                 layout: LocalLayout = LOCAL_LAYOUT) -> jax.Array:
        """layout: where the call runs; its kernels pick the attention (cuDNN's, XLA's
        or blockwise: `Kernels.attention`), and it reaches the rest of each sequence
        where the call holds a chunk of positions (`LocalLayout.attend`)."""
        with jax.named_scope("attention"):
            q, k, v = self.qkv(x_BxLxD, positions_BxL)
            o = layout.attend(causal_attention(self.cfg, layout), q, k, v)
            return self.out(checkpoint_name(o, ATTENTION_OUT))


def rotate(x_BxLxHxHd: jax.Array, positions_BxL: jax.Array, cfg: ModelConfig) -> jax.Array:
    """`cfg`'s RoPE (its frequencies, YaRN's stretch, its pair layout) of x's first
    `rotary_dims` dimensions per head."""
    inv_freq, scale = rope_frequencies(cfg)
    return rope(x_BxLxHxHd, positions_BxL, cfg.rope_theta, cfg.rotary_dims, inv_freq=inv_freq,
                scale=scale, interleave=cfg.rope_interleave)


def causal_attention(cfg: ModelConfig, layout: LocalLayout):
    """attention(q, k, v) -> o: causal over whole sequences, at `cfg`'s softmax scale,
    in the kernel `layout`'s devices run (cuDNN's, XLA's or blockwise)."""
    impl, scale = layout.kernels.attention(cfg), softmax_scale(cfg)

    @narrow_values
    def attention(q, k, v):
        if impl == "blockwise":
            return blockwise_attention(q, k, v, cfg.attention_block, scale)
        # both handle GQA (H a multiple of G)
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                            implementation=impl)

    return attention


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
