"""The device mesh and the rules that place every tensor on it.

Mesh axes: `data` (replicas), `stage` (pipeline stages), `context` (each sequence
split into chunks of positions over devices), `expert` (experts split across
devices; outside MoE layers also a batch axis). Batch rows are split over `data`
and `expert`; every device of a `context` group holds the same rows, a chunk of
their positions each. `expert` is innermost, then `context`, and devices are
ordered host by host, so that an expert group (then a context group, and a
pipeline) is made of adjacent devices of one host, on its fast links.

Parameters carry logical axis names (`layers`, `vocab`, `embed`, `heads`, ...);
one table per parallel mode maps them to mesh axes.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxmoe.config import MESH_AXES, ConfigError, MeshConfig

AXES = MESH_AXES
BATCH_AXES = ("data", "expert")
# the axes whose devices hold different tokens: a per-token statistic is totalled over them
TOKEN_AXES = ("data", "context", "expert")

_DDP = {
    "layers": "stage",
    "experts": "expert",  # experts live on the devices that own them
    # everything else (vocab, embed, heads, kv_heads, head_dim, mlp, expert_mlp,
    # experts_replicated) is replicated: dense weights are data-parallel replicas
}
# FSDP, the design jaxmoe moves away from, kept to compare against: weights are
# additionally split over `data` along the model dimension and re-gathered at use.
_FSDP = {**_DDP, "embed": "data"}
RULES: dict[str, dict[str, str]] = {"ddp": _DDP, "fsdp": _FSDP}


def mesh_shape(cfg: MeshConfig, num_devices: int, num_processes: int = 1) -> dict[str, int]:
    """Resolves -1 and checks the product against the devices present."""
    present = (f"{num_devices} are present" if num_processes == 1 else
               f"the {num_processes} processes hold {num_devices} together")
    shape = {a: getattr(cfg, a) for a in AXES}
    known = math.prod(v for v in shape.values() if v != -1)
    for axis, v in shape.items():
        if v == -1:
            if num_devices % known:
                raise ConfigError(f"mesh.{axis}: -1 cannot fill {num_devices} devices "
                                  f"with the other axes using {known}")
            shape[axis] = num_devices // known
    if math.prod(shape.values()) != num_devices:
        raise ConfigError(f"mesh: {describe(shape)} = {math.prod(shape.values())} devices, "
                          f"but {present}")
    return shape


def describe(shape) -> str:
    """"data=2 x stage=1 x expert=4": a mesh's shape, `context` named where it splits."""
    return " x ".join(f"{a}={shape[a]}" for a in AXES if a != "context" or shape[a] != 1)


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    try:
        shape = mesh_shape(cfg, len(devices), len({d.process_index for d in devices}))
    except ConfigError as e:
        wanted = math.prod(max(getattr(cfg, a), 1) for a in AXES)
        if devices[0].platform == "cpu" and wanted > len(devices):
            raise ConfigError(f"{e} (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count="
                              f"{wanted} set before JAX starts gives {wanted} devices)") from None
        raise
    return Mesh(device_grid(shape, devices), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def device_grid(shape: dict[str, int], devices: list) -> np.ndarray:
    """Devices host by host, reshaped to (data, stage, context, expert).

    With `data` outermost, each host's devices fill whole stage x context x expert
    groups when their count is a multiple of the group's; a group larger than a
    host spans whole adjacent hosts (its collectives then cross the network).
    """
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    per_process = Counter(d.process_index for d in devices)
    group = shape["stage"] * shape["context"] * shape["expert"]
    if len(per_process) > 1:
        counts = sorted(set(per_process.values()))
        if len(counts) > 1:
            raise ConfigError(f"mesh: processes hold different numbers of devices {counts}; "
                              "every process must bring the same number")
        local = counts[0]
        if local % group and group % local:
            raise ConfigError(f"mesh: stage x expert = {group} devices neither divides the "
                              f"{local} devices of each process nor is a multiple of it, so "
                              "expert groups would straddle processes unevenly")
    return np.array(devices, dtype=object).reshape(tuple(shape[a] for a in AXES))


def axis_size(mesh: Mesh, axis: str) -> int:
    """The size of a mesh axis; 1 for an axis a caller's own mesh does not have."""
    return mesh.shape.get(axis, 1)


def logical_spec(names: tuple[str | None, ...], rules: dict[str, str]) -> P:
    return P(*(rules.get(n) if n else None for n in names))


def _names(var: nnx.Variable) -> tuple[str | None, ...]:
    names = var.get_metadata().get("out_sharding")
    return tuple(names) if names else (None,) * var.ndim


def state_specs(state: Any, rules: dict[str, str]) -> Any:
    """PartitionSpecs for an nnx.State from its variables' logical names."""
    return jax.tree.map(lambda v: v.replace(logical_spec(_names(v), rules)), state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a PartitionSpec splits its dimension over."""
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def zero1_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """Adds the tensor's replica axes (mesh axes it is not split over) to one dim.

    ZeRO-1: each optimizer-state tensor is divided among the devices that hold
    a replica of its parameter. The first dimension that divides evenly takes
    the replica axes; a tensor too small to divide stays replicated.
    """
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    used = {a for s in spec for a in spec_axes(s)}
    replica = tuple(a for a in TOKEN_AXES if a not in used and axis_size(mesh, a) > 1)
    if not replica:
        return P(*spec)
    n = math.prod(mesh.shape[a] for a in replica)
    for i, (dim, s) in enumerate(zip(shape, spec)):
        held = spec_axes(s)
        per_shard = dim // math.prod(mesh.shape[a] for a in held) if held else dim
        if per_shard % n == 0 and per_shard >= n:
            new = list(spec)
            new[i] = held + replica if held else (replica if len(replica) > 1 else replica[0])
            return P(*new)
    return P(*spec)


def named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def process_rows(sharding: NamedSharding, batch_size: int,
                 process: int | None = None) -> tuple[int, int]:
    """(index, count): a process's devices (this one's by default) hold block `index`
    of `count` equal, contiguous blocks of a batch's rows (processes on one replica
    share a block)."""
    process = jax.process_index() if process is None else process
    slices = {(s.start or 0, s.stop or batch_size) for d, (s, *_) in
              sharding.devices_indices_map((batch_size,)).items() if d.process_index == process}
    lo, hi = min(a for a, _ in slices), max(b for _, b in slices)
    rows = hi - lo
    if sum(b - a for a, b in slices) != rows or batch_size % rows or lo % rows:
        raise ConfigError(f"mesh: process {process}'s devices hold batch rows {sorted(slices)}, "
                          "not one contiguous block; order the mesh host by host")
    return lo // rows, batch_size // rows


def from_whole(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process holds whole (each process
    places its devices' pieces)."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def per_device_shapes(array: jax.Array) -> set[tuple[int, ...]]:
    """The shapes of an array's shards, for tests and the planner."""
    return {tuple(s.data.shape) for s in array.addressable_shards}


def fraction_per_device(array: jax.Array) -> float:
    return float(np.prod(next(iter(per_device_shapes(array))))) / max(array.size, 1)


def constrain_batch(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Pins activations to batch sharding, so weights are gathered (fsdp) rather than
    activations split along the model dimension."""
    if mesh is None:
        return x
    spec = P(BATCH_AXES, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
