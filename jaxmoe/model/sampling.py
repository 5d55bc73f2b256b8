"""Next-token sampling: temperature, top-k and top-p (nucleus), pure and keyed.

Every knob may be a traced scalar, so changing one does not recompile.
temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits_BxV: jax.Array, top_k: jax.Array | int = 0,
                  top_p: jax.Array | float = 1.0) -> jax.Array:
    """Logits with everything outside the top-k, then outside the top-p mass, set to -inf.

    The top-p set is the smallest prefix of the sorted distribution (after top-k)
    whose mass reaches top_p; the most likely token always stays.
    """
    V = logits_BxV.shape[-1]
    sorted_BxV = -jnp.sort(-logits_BxV, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    sorted_BxV = jnp.where(jnp.arange(V) < k, sorted_BxV, -jnp.inf)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    kept_BxV = (mass_before_BxV < top_p) & (jnp.arange(V) < k)
    kept_BxV = kept_BxV.at[:, 0].set(True)
    threshold_B = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1)
    return jnp.where(logits_BxV >= threshold_B[:, None], logits_BxV, -jnp.inf)


def sample(key: jax.Array, logits_BxV: jax.Array, temperature: jax.Array | float = 1.0,
           top_k: jax.Array | int = 0, top_p: jax.Array | float = 1.0) -> jax.Array:
    """int32 [B] next tokens drawn from softmax(logits / temperature), filtered."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    scaled_BxV = logits_BxV / jnp.maximum(temperature, 1e-6)
    drawn_B = jax.random.categorical(key, filter_logits(scaled_BxV, top_k, top_p), axis=-1)
    greedy_B = jnp.argmax(logits_BxV, axis=-1)
    return jnp.where(temperature > 0, drawn_B, greedy_B).astype(jnp.int32)
