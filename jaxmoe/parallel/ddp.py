"""Each gradient's way through the ddp step: computed per device, reduced once.

Inside the step's `shard_map` every device holds its dense replicas, its slice of
the experts and its own rows. Before the gradient is taken each weight is cast
to a per-device value over the batch axes it is not split on (`pcast` to
"varying"): without the cast, autodiff would sum the gradient of every
replicated weight over the devices at every use, inside the layer scan and the
micro-batch loop. After the last micro-batch each gradient is reduced once, over
exactly the axes that hold a copy of its parameter: a `psum_scatter` straight
into the optimizer's ZeRO-1 shard where the state is split, a `psum` where it
is not (ZeRO-1 off, or a tensor too small to divide).

A parameter can also reach the model as its `Sharded` ZeRO-1 shard, the gather
left to where it is used: a pipeline gathers a later round's weights piece by
piece while an earlier round computes (`parallel.pipeline.device_pipeline`), a
layer scan the next layer's while a layer computes
(`parallel.layout.DeviceLayout.run_moe_stack`). The transpose of that gather is
the gradient's reduce-scatter, in the same loop of the backward pass, beside the
compute of the layers before it, so such a gradient arrives reduced.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxmoe.ops.vma import vary
from jaxmoe.parallel.sharding import spec_axes


@dataclass(frozen=True)
class Reduction:
    """How one parameter's gradient is reduced and where its update lives."""

    varying_axes: tuple[str, ...]  # mesh axes the parameter is replicated over (pcast)
    sum_axes: tuple[str, ...]  # replica axes reduced with a psum
    scatter_axes: tuple[str, ...]  # replica axes its optimizer state is split over
    dim: int  # the dimension they split (unused without scatter_axes)
    copies: int  # devices holding each element of the reduced gradient


def reduction(param_spec: P, opt_spec: P, mesh: Mesh) -> Reduction:
    """The plan for a parameter placed by `param_spec` whose optimizer state is
    placed by `opt_spec` (`sharding.zero1_spec` of it, or the same spec)."""
    held = {a for e in param_spec for a in spec_axes(e)}
    varying = tuple(a for a in mesh.axis_names if a not in held)
    scatter, dim = (), 0
    padded = tuple(param_spec) + (None,) * (len(opt_spec) - len(param_spec))
    for i, (p_entry, o_entry) in enumerate(zip(padded, tuple(opt_spec))):
        added = tuple(a for a in spec_axes(o_entry) if a not in spec_axes(p_entry))
        if added:
            scatter, dim = added, i
    # size-1 axes too: the reduced value must be invariant over every axis it does
    # not split (XLA keeps such ops over groups of one; they send nothing)
    sums = tuple(a for a in varying if a not in scatter)
    return Reduction(varying, sums, scatter, dim, math.prod(mesh.shape[a] for a in sums))


@jax.tree_util.register_pytree_node_class
class Sharded:
    """A parameter's ZeRO-1 shard and its plan: gathered where it is used."""

    def __init__(self, shard: jax.Array, plan: Reduction):
        self.shard, self.plan = shard, plan

    def tree_flatten(self):
        return (self.shard,), self.plan

    @classmethod
    def tree_unflatten(cls, plan, children):
        return cls(children[0], plan)

    def per_layer(self) -> Sharded:
        """The shard of a stacked tensor as a scan over its leading axis sees it: each
        slice's plan (the split one axis lower)."""
        assert self.plan.dim >= 1, "a shard split along its layers has no per-layer view"
        return Sharded(self.shard, dataclasses.replace(self.plan, dim=self.plan.dim - 1))

    def at(self, index: int) -> Sharded:
        """The shard of the tensor's slice `index` along its first axis."""
        return Sharded(self.shard[index], dataclasses.replace(self.plan, dim=self.plan.dim - 1))

    def gathered(self) -> jax.Array:
        """The whole tensor, per device: an all-gather whose transpose is the gradient's
        reduce-scatter (the plan's axes are the tensor's only replica axes)."""
        return lax.all_gather(self.shard, self.plan.scatter_axes, axis=self.plan.dim, tiled=True)

    def gathered_part(self, part: int | jax.Array, parts: int) -> jax.Array:
        """`gathered()[..., part of parts along the last axis]`, gathering only that."""
        n = self.shard.shape[-1] // parts
        return Sharded(lax.dynamic_slice_in_dim(self.shard, part * n, n, axis=-1),
                       self.plan).gathered()

    def joined(self, parts_N: jax.Array) -> jax.Array:
        """`gathered()` from the `gathered_part`s of every part, stacked [N, ...]."""
        N, last = parts_N.shape[0], self.plan.dim == self.shard.ndim - 1
        if last:  # each part holds its slice of every device's shard, device-major
            devices = parts_N.shape[-1] * N // self.shard.shape[-1]
            parts_N = parts_N.reshape(*parts_N.shape[:-1], devices, -1)
        whole = jnp.moveaxis(parts_N, 0, -2)  # [..., (devices,) N, n]
        return whole.reshape(*whole.shape[:-3 if last else -2], -1)


def reduce_gradient(g: jax.Array, r: Reduction) -> jax.Array:
    """The sum of every device's gradient, as this device's share of the optimizer state."""
    if r.sum_axes:
        g = lax.psum(g, r.sum_axes)
    if r.scatter_axes:
        g = lax.psum_scatter(g, r.scatter_axes, scatter_dimension=r.dim, tiled=True)
    return g


def own_shard(x: jax.Array, r: Reduction) -> jax.Array:
    """This device's block of a replicated x, as ZeRO-1 splits its optimizer state."""
    if not r.scatter_axes:
        return x
    n = math.prod(lax.axis_size(a) for a in r.scatter_axes)
    size = x.shape[r.dim] // n
    return lax.dynamic_slice_in_dim(x, lax.axis_index(r.scatter_axes) * size, size, r.dim)


def gather_shards(x: jax.Array, r: Reduction) -> jax.Array:
    """The whole tensor from every device's ZeRO-1 block (`own_shard`'s inverse)."""
    if not r.scatter_axes:
        return x
    return lax.all_gather(x, r.scatter_axes, axis=r.dim, tiled=True, to="invarying")


def to_per_device(w: jax.Array, r: Reduction) -> jax.Array:
    """w as a per-device value, so its gradient stays local until `reduce_gradient`."""
    return vary(w, r.varying_axes)


def global_norm(grads, reductions, mesh: Mesh) -> jax.Array:
    """The global L2 norm of reduced gradients, each element counted once."""
    local = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) / r.copies
                for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reductions, is_leaf=_is_red)))
    return jnp.sqrt(psum_everywhere(local, mesh.axis_names))


def psum_everywhere(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """psum over `axes`, x first made per-device over those it does not vary on
    (psum takes no mix of the two)."""
    return lax.psum(vary(x, axes), axes)


def _is_red(x) -> bool:
    return isinstance(x, Reduction)


def reductions(param_specs, opt_specs, mesh: Mesh):
    """`reduction` for every parameter, in the parameters' tree."""
    return jax.tree.map(lambda p, o: reduction(p, o, mesh), param_specs, opt_specs,
                        is_leaf=lambda x: isinstance(x, P))
