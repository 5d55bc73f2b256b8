"""Multi-head latent attention (DeepSeek-V2, V3; Kimi-K2): `model.attention: mla`.

Each token's keys and values come from one latent of kv_lora_rank numbers (RMS-
normalised), expanded per head by `w_kv_b` into a key part without RoPE
(qk_nope_head_dim) and a value (v_head_dim); the key's RoPE part (qk_rope_head_dim)
is projected from the token once and shared by every head. Queries go through a
q_lora_rank bottleneck with its own norm (or one projection when q_lora_rank is
0) and carry both parts. What a decoder must keep per token is the latent and the
shared RoPE key, kv_lora_rank + qk_rope_head_dim numbers, against 2 H Hd for
grouped-query attention with as many heads.

The attention itself is the ordinary causal one over H heads of
qk_nope + qk_rope dimensions (values narrower, `attention.causal_attention`), at
DeepSeek's softmax scale (`attention.softmax_scale`).

Shapes: Rq q_lora_rank, Rkv kv_lora_rank, Hn and Hr a head's parts without and
with RoPE (Hd = Hn + Hr), Hv its value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmoe.config import ModelConfig
from jaxmoe.model.attention import attend, rotate
from jaxmoe.model.layers import param, project, rms_norm
from jaxmoe.model.layout import LOCAL_LAYOUT, LocalLayout
from jaxmoe.model.remat import ATTENTION_QKV

# transformers' DeepseekV3RMSNorm default: the latents' norms take no config's eps
LATENT_NORM_EPS = 1e-6


class LatentAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, out_std: float, rngs: nnx.Rngs):
        D, H, std = cfg.d_model, cfg.num_heads, cfg.init_std
        Rq, Rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        Hn, Hr, Hv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if Rq:
            self.w_q_a = param(rngs, (D, Rq), ("embed", "q_lora"), std)
            self.q_a_norm = param(rngs, (Rq,), ("q_lora",), value=1.0)
            self.w_q_b = param(rngs, (Rq, H, Hn + Hr), ("q_lora", "heads", "head_dim"), std)
        else:
            self.w_q = param(rngs, (D, H, Hn + Hr), ("embed", "heads", "head_dim"), std)
        # the latent, then the shared RoPE key, in one projection (as checkpoints hold it)
        self.w_kv_a = param(rngs, (D, Rkv + Hr), ("embed", "kv_lora"), std)
        self.kv_a_norm = param(rngs, (Rkv,), ("kv_lora",), value=1.0)
        self.w_kv_b = param(rngs, (Rkv, H, Hn + Hv), ("kv_lora", "heads", "head_dim"), std)
        self.w_o = param(rngs, (H, Hv, D), ("heads", "head_dim", "embed"), out_std)
        self.cfg = cfg

    def latent(self, x_BxLxD: jax.Array, positions_BxL: jax.Array):
        """What a token leaves for later queries: its normalised latent [B, L, Rkv] and
        its rotated RoPE key [B, L, Hr]."""
        cfg = self.cfg
        kv = project("bld,dr->blr", x_BxLxD, self.w_kv_a.get_value())
        c_BxLxRkv, k_rot_BxLxHr = jnp.split(kv, [cfg.kv_lora_rank], axis=-1)
        c_BxLxRkv = rms_norm(c_BxLxRkv, self.kv_a_norm[...], LATENT_NORM_EPS)
        return c_BxLxRkv, rotate(k_rot_BxLxHr[:, :, None, :], positions_BxL, cfg)[:, :, 0]

    def queries(self, x_BxLxD: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """[B, L, H, Hn + Hr]: each head's query, its RoPE part rotated."""
        cfg = self.cfg
        if cfg.q_lora_rank:
            c_BxLxRq = project("bld,dr->blr", x_BxLxD, self.w_q_a.get_value())
            c_BxLxRq = rms_norm(c_BxLxRq, self.q_a_norm[...], LATENT_NORM_EPS)
            q = project("blr,rhk->blhk", c_BxLxRq, self.w_q_b.get_value())
        else:
            q = project("bld,dhk->blhk", x_BxLxD, self.w_q.get_value())
        q_nope, q_rot = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
        return jnp.concatenate([q_nope, rotate(q_rot, positions_BxL, cfg)], axis=-1)

    def expand(self, c_BxLxRkv: jax.Array, k_rot_BxLxHr: jax.Array):
        """Each head's key [B, L, H, Hn + Hr] and value [B, L, H, Hv] from the latents."""
        cfg = self.cfg
        kv = project("blr,rhk->blhk", c_BxLxRkv, self.w_kv_b.get_value())
        k_nope, v = jnp.split(kv, [cfg.qk_nope_head_dim], axis=-1)
        k_rot = jnp.broadcast_to(k_rot_BxLxHr[:, :, None, :],
                                 k_nope.shape[:3] + k_rot_BxLxHr.shape[-1:])
        return jnp.concatenate([k_nope, k_rot.astype(k_nope.dtype)], axis=-1), v

    def qkv(self, x_BxLxD: jax.Array, positions_BxL: jax.Array):
        q = checkpoint_name(self.queries(x_BxLxD, positions_BxL), ATTENTION_QKV)
        k, v = self.expand(*self.latent(x_BxLxD, positions_BxL))
        return q, checkpoint_name(k, ATTENTION_QKV), checkpoint_name(v, ATTENTION_QKV)

    def cached(self, x_BxLxD: jax.Array, positions_BxL: jax.Array):
        """(queries, what a decoder keeps of these tokens): the latent and the rotated
        RoPE key, Rkv + Hr numbers per token (`jaxmoe.model.kv_cache`)."""
        return self.queries(x_BxLxD, positions_BxL), self.latent(x_BxLxD, positions_BxL)

    def keys_values(self, c_BxLcxRkv: jax.Array, k_rot_BxLcxHr: jax.Array):
        """Every head's keys and values from the cached latents, expanded at each call."""
        return self.expand(c_BxLcxRkv, k_rot_BxLcxHr)

    @staticmethod
    def cache_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
        return (cfg.kv_lora_rank,), (cfg.qk_rope_head_dim,)

    def out(self, o_BxLxHxHv: jax.Array) -> jax.Array:
        return project("blhk,hkd->bld", o_BxLxHxHv, self.w_o.get_value())

    def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array,
                 layout: LocalLayout = LOCAL_LAYOUT, with_max_logits: bool = False):
        """As `Attention`'s."""
        return attend(self, x_BxLxD, positions_BxL, layout, with_max_logits)
