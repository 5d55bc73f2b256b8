"""QK-clip (MuonClip's, Kimi K2): heads whose attention logits grew past a threshold
have their query and key projections scaled back after the update.

With `optimizer.qk_clip: tau` every layer reports each head's largest logit in the
step, S = max over rows and causal pairs of scale q_i . k_j (`attention.max_logits`,
the maximum taken over micro-batches, stages and devices). After the optimizer's
update, a head with S > tau has its projections scaled so that, for the same
inputs, every one of its logits is gamma = tau / S times what it was:

- grouped-query attention: key head g is shared by its group's query heads, so it
  takes sqrt(min gamma over the group) and each query head h the rest, gamma_h /
  sqrt(gamma_g) (for one query head per key head, sqrt(gamma) each: Kimi's split);
- MLA: the query's and key's parts without RoPE take sqrt(gamma) each, the query's
  RoPE part gamma, and the RoPE key, one for every head, is left alone; values are
  untouched.

RoPE and YaRN rotate q and k linearly, so scaling the projections scales the logits
exactly. QK-norm would undo the scaling: the two are refused together. A step that
is skipped (a non-finite loss or gradient, an overflow rerun) clips nothing.

The factors are computed per layer in model order (dense layers, MoE layers, MTP
modules' layers) and reach each tensor as the program holds it: the MoE stack's
as its stages hold it, and each as its ZeRO-1 part.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxmoe.config import Config
from jaxmoe.optim.params import param_name

# where each kind of stack keeps its attention
STACKS = ("dense_layers/attn/", "moe_layers/attn/", "mtp_layers/block/attn/")


def head_scales(max_logit_NxH: jax.Array, threshold: float) -> jax.Array:
    """gamma [N, H]: tau / S for heads over the threshold, 1 for the rest."""
    over = max_logit_NxH > threshold
    return jnp.where(over, threshold / jnp.where(over, max_logit_NxH, 1.0), 1.0)


def factors(cfg: Config, gamma_NxH: jax.Array) -> dict[str, jax.Array]:
    """By tensor name within a layer's attention ("w_q", "w_k", ...): the factor of a
    stack of N layers' tensor [N, ..., heads, head_dim], shaped [N, 1, heads, 1 or
    head_dim] to broadcast against it."""
    m = cfg.model
    N, H = gamma_NxH.shape
    root = jnp.sqrt(gamma_NxH)
    if m.attention == "mla":
        Hn, Hr, Hv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        part = lambda g, n: jnp.broadcast_to(g[:, None, :, None], (N, 1, H, n))  # noqa: E731
        query = jnp.concatenate([part(root, Hn), part(gamma_NxH, Hr)], axis=-1)
        key_value = jnp.concatenate([part(root, Hn), part(jnp.ones_like(root), Hv)], axis=-1)
        return {"w_q": query, "w_q_b": query, "w_kv_b": key_value}
    G = m.num_kv_heads
    group_NxG = jnp.sqrt(jnp.min(gamma_NxH.reshape(N, G, H // G), axis=-1))
    query = gamma_NxH / jnp.repeat(group_NxG, H // G, axis=1)
    return {"w_q": query[:, None, :, None], "w_k": group_NxG[:, None, :, None]}


def rescaled(cfg: Config, params, max_logit_NxH: jax.Array, apply: jax.Array,
             own_layers: Callable, own_part: Callable):
    """`params` (as the step's optimizer holds them) with QK-clip applied where `apply`.

    max_logit_NxH: every layer's heads' largest logits, model order, MTP layers last;
    own_layers: [Lm, ...] per-MoE-layer values -> as the program holds the MoE stack
    (`jaxmoe.step.program.Program.own_layers`); own_part(name, factor): a factor of the whole
    tensor -> that of the program's part of it (its ZeRO-1 shard)."""
    gamma = head_scales(max_logit_NxH, cfg.optimizer.qk_clip)
    gamma = jnp.where(apply, gamma, 1.0)
    Ld, Lm = cfg.model.num_dense_layers, cfg.num_moe_layers
    per_stack = {STACKS[0]: (factors(cfg, gamma[:Ld]) if Ld else {}, lambda f: f),
                 STACKS[1]: (factors(cfg, gamma[Ld:Ld + Lm]) if Lm else {}, own_layers),
                 STACKS[2]: (factors(cfg, gamma[Ld + Lm:]) if cfg.model.mtp_layers else {},
                             lambda f: f)}

    def scale(path, p):
        name = param_name(path)
        for prefix, (by_tensor, held) in per_stack.items():
            tensor = name.removeprefix(prefix)
            if name.startswith(prefix) and tensor in by_tensor:
                factor = own_part(name, held(by_tensor[tensor]))
                return (p.astype(jnp.float32) * factor).astype(p.dtype)
        return p

    return jax.tree_util.tree_map_with_path(scale, params)

