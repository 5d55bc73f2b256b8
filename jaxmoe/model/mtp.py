"""Multi-token prediction (DeepSeek-V3): modules after the last layer, the k-th
predicting the token k + 1 ahead.

Module k (1 .. model.mtp_layers) at position i takes the previous depth's hidden
state h[k-1]_i (h[0]: the main model's last layer output, before its final norm)
and the embedding of token t[i+k]: a projection of [norm(embedding); norm(hidden)]
(the order DeepSeek's checkpoints store `eh_proj` in) through one transformer
layer (MoE where the model's layers are) gives h[k]_i, and the module's own norm
and the model's LM head predict t[i+k+1]. The embedding and the head are shared
with the main model. Attention is causal, so no position sees past t[i+k]; the
last k positions of a row, whose targets lie past its end, count for nothing.

Training only: generation and scoring run the main model alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.model.layers import RMSNorm, param
from jaxmoe.model.layout import LOCAL_LAYOUT, LocalLayout


class MTPModule(nnx.Module):
    def __init__(self, d_model: int, norm_eps: float, std: float, block: nnx.Module,
                 rngs: nnx.Rngs):
        """block: the module's transformer layer (`transformer.Block`)."""
        self.embed_norm = RMSNorm(d_model, norm_eps, "embed", rngs)
        self.hidden_norm = RMSNorm(d_model, norm_eps, "embed", rngs)
        # [embedding; hidden] -> model width: DeepSeek's eh_proj
        self.proj = param(rngs, (2 * d_model, d_model), ("mtp_in", "embed"), std)
        self.block = block
        self.out_norm = RMSNorm(d_model, norm_eps, "embed", rngs)

    def __call__(self, h_BxLxD, embedded_BxLxD, positions_BxL, layout: LocalLayout = LOCAL_LAYOUT,
                 jitter_key=None) -> tuple[jax.Array, dict]:
        """This depth's hidden state [B, L, D] (before `out_norm`) and its layer's aux."""
        joined = jnp.concatenate([self.embed_norm(embedded_BxLxD), self.hidden_norm(h_BxLxD)],
                                 axis=-1)
        x_BxLxD = jnp.einsum("blc,cd->bld", joined, self.proj[...].astype(joined.dtype))
        return self.block(x_BxLxD, positions_BxL, layout, jitter_key)


def valid_targets(positions_BxL: jax.Array, length: int, depth: int) -> jax.Array:
    """Where depth `depth`'s target t[i + depth + 1] lies inside rows of `length`
    inputs (`length` + 1 tokens): i < length - depth."""
    return positions_BxL < length - depth
