"""Which mesh axes a value varies over inside a `shard_map`, read in one place.

JAX (0.10 on) keeps them on a value's type, `jax.typeof(x).manual_axis_type.varying`
(on a `jax.ShapeDtypeStruct` from `eval_shape` too); outside a `shard_map` the set
is empty. `check_vma` holds collectives and custom VJPs to these types, so the
code that builds values inside the per-device step casts with `vary`.
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset[str]:
    """The mesh axes `x` (an array, tracer or ShapeDtypeStruct) varies over."""
    t = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    manual = t.manual_axis_type  # None on a ShapeDtypeStruct made outside a shard_map
    return frozenset(manual.varying) if manual is not None else frozenset()


def vary(x: jax.Array, axes) -> jax.Array:
    """`x` typed as varying over `axes` too (a no-op for those it varies over already)."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x
