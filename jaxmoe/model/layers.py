"""Small building blocks: parameters with logical axes, RMSNorm, RoPE, SwiGLU MLP.

Shape alphabet (docs/reference/architecture.md has all of it): B batch, L length, D model, H heads, G kv
heads, Hd head size, F hidden, E experts, K top-k, T tokens (B L), V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.ops.mx import MXProjection, mx_project


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...],
          std: float | None = None, value: float | None = None) -> nnx.Param:
    """An fp32 parameter carrying logical axis names (mapped to the mesh by sharding.py)."""
    assert len(shape) == len(axes), (shape, axes)
    if value is not None:
        init = jnp.full(shape, value, jnp.float32)
    else:
        init = std * jax.random.truncated_normal(rngs.params(), -3.0, 3.0, shape, jnp.float32)
    return nnx.Param(init, out_sharding=axes, eager_sharding=False)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, axis=-1) -> jax.Array:
    """RMSNorm over `axis` (one axis, or a tuple: the trailing axes taken as one vector)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis_name: str, rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), (axis_name,), value=1.0)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


def rope_frequencies(cfg) -> tuple[np.ndarray, float]:
    """(inverse frequencies [R / 2], cos/sin scale) of `cfg`'s (a ModelConfig's) RoPE
    over its `rotary_dims` dimensions: theta^(-2i/R), or YaRN's blend of them with the
    stretched ones (transformers' yarn rope type, correction range truncated), whose
    cos and sin are scaled by mscale(factor, yarn_mscale) / mscale(factor,
    yarn_mscale_all_dim) (1 for DeepSeek-V3's released values)."""
    R, theta = cfg.rotary_dims, cfg.rope_theta
    inv_freq = 1.0 / theta ** (np.arange(0, R, 2, dtype=np.float64) / R)
    factor = cfg.yarn_factor
    if not factor:
        return inv_freq.astype(np.float32), 1.0

    def correction_dim(rotations: float) -> float:  # the dimension turning that often
        return R * math.log(cfg.yarn_original_max_positions / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), R - 1)
    ramp = np.clip((np.arange(R // 2, dtype=np.float64) - low)
                   / ((high - low) if high != low else 0.001), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: the original frequency (fast dimensions), 0: stretched
    inv_freq = inv_freq / factor * (1.0 - keep) + inv_freq * keep
    scale = (yarn_mscale(factor, cfg.yarn_mscale) / yarn_mscale(factor, cfg.yarn_mscale_all_dim)
             if cfg.yarn_mscale and cfg.yarn_mscale_all_dim else yarn_mscale(factor))
    return inv_freq.astype(np.float32), float(scale)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term, 0.1 mscale ln(factor) + 1 (1 without stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope(x_BxLxHxHd: jax.Array, positions_BxL: jax.Array, theta: float,
         rotary_dims: int | None = None, *, inv_freq=None, scale: float = 1.0,
         interleave: bool = False) -> jax.Array:
    """Rotary position embedding, computed in fp32, of a head's first `rotary_dims`
    dimensions (all when None); the rest pass through, and the frequencies span the
    rotated ones (as GLM-4.5's partial rotary). inv_freq: the frequencies
    (`rope_frequencies`; None: theta's), scale: on cos and sin (YaRN's).
    Pairs (i, i + R/2) rotate together; `interleave`: pairs (2i, 2i + 1), written
    back as rotate-half lays them out (evens then odds, as transformers does), which
    changes no dot product of rotated queries and keys."""
    R = rotary_dims or x_BxLxHxHd.shape[-1]
    freq = (theta ** (-jnp.arange(0, R // 2, dtype=jnp.float32) * 2.0 / R) if inv_freq is None
            else jnp.asarray(inv_freq, jnp.float32))
    angle_BxLxR2 = positions_BxL[..., None].astype(jnp.float32) * freq
    sin = (jnp.sin(angle_BxLxR2) * scale)[:, :, None, :]
    cos = (jnp.cos(angle_BxLxR2) * scale)[:, :, None, :]
    rotated, passed = jnp.split(x_BxLxHxHd.astype(jnp.float32), [R], axis=-1)
    if interleave:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
    else:
        x1, x2 = jnp.split(rotated, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, passed], axis=-1)
    return out.astype(x_BxLxHxHd.dtype)


def project(spec: str, x: jax.Array, w) -> jax.Array:
    """`jnp.einsum(spec, x, w)` in x's dtype: x's last axes contracted with the first
    axes of a weight w stored [*In, *Out]. Where a step attached the weight's MXFP8
    copies (an `MXProjection`: `jaxmoe.model.mx_weights`), the same product in MXFP8."""
    if isinstance(w, MXProjection):
        x_spec, w_spec = spec.split("->")[0].split(",")
        return mx_project(x, w, len(set(x_spec) & set(w_spec)))
    return jnp.einsum(spec, x, w.astype(x.dtype))


def swiglu(x: jax.Array, w_gate_up, w_down) -> jax.Array:
    """SwiGLU with the gate and up projections fused in one [D, 2F] matmul (weights as
    `project` takes them)."""
    h = project("...d,df->...f", x, w_gate_up)
    gate, up = jnp.split(h, 2, axis=-1)
    return project("...f,fd->...d", jax.nn.silu(gate) * up, w_down)


class MLP(nnx.Module):
    """Dense SwiGLU feed-forward."""

    def __init__(self, d_model: int, hidden: int, std: float, out_std: float, rngs: nnx.Rngs,
                 hidden_axis: str = "mlp"):
        self.w_gate_up = param(rngs, (d_model, 2 * hidden), ("embed", hidden_axis), std)
        self.w_down = param(rngs, (hidden, d_model), (hidden_axis, "embed"), out_std)

    def __call__(self, x: jax.Array) -> jax.Array:
        return swiglu(x, self.w_gate_up.get_value(), self.w_down.get_value())
