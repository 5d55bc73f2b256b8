"""Causal grouped-query attention with RoPE and optional QK-norm (per head or over the
whole projection)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config import ModelConfig
from jaxmoe.model.blockwise_attention import blockwise_attention
from jaxmoe.model.layers import param, rms_norm, rope
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
        R = cfg.rotary_dims
        return (rope(q, positions_BxL, cfg.rope_theta, R), rope(k, positions_BxL, cfg.rope_theta, R),
                v)

    def out(self, o_BxLxHxHd: jax.Array) -> jax.Array:
        return jnp.einsum("blhk,hkd->bld", o_BxLxHxHd, self.w_o[...].astype(o_BxLxHxHd.dtype))

    def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array,
                 layout: LocalLayout = LOCAL_LAYOUT) -> jax.Array:
        """layout: where the call runs; its kernels pick the attention (cuDNN's, XLA's
        or blockwise: `Kernels.attention`), and it reaches the rest of each sequence
        where the call holds a chunk of positions (`LocalLayout.attend`)."""
        impl = layout.kernels.attention(self.cfg)

        def causal(q, k, v):
            if impl == "blockwise":
                return blockwise_attention(q, k, v, self.cfg.attention_block)
            # both handle GQA (H a multiple of G)
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

        with jax.named_scope("attention"):
            q, k, v = self.qkv(x_BxLxD, positions_BxL)
            o = layout.attend(causal, q, k, v)
            return self.out(checkpoint_name(o, ATTENTION_OUT))
