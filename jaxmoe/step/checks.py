"""The config's checks that need its devices: the mesh it resolved to, and the model's
parameters placed on it. `build_steps` runs them before anything compiles; what a config
must satisfy alone is `jaxmoe.config.checks`."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxmoe.config import Config, ConfigError, check_context_split, check_expert_split
from jaxmoe.model.dispatch import LOCAL
from jaxmoe.ops.kernels import Kernels
from jaxmoe.optim.optax_bridge import updates_are_elementwise
from jaxmoe.optim.params import param_names, unmatched_patterns
from jaxmoe.parallel import sharding
from jaxmoe.parallel.sharding import axis_size


def uses_per_device_step(cfg: Config) -> bool:
    """ddp trains (and evaluates) with the per-device program, pipelines included."""
    return cfg.mesh.parallelism == "ddp"


def check_mesh(cfg: Config, mesh: Mesh) -> None:
    """The config against the mesh it resolved to (`mesh.data: -1` resolves only here)."""
    n_batch = mesh.shape["data"] * mesh.shape["expert"]
    per_micro = (cfg.train.batch_size // cfg.train.accumulation_steps
                 // cfg.pipeline.stage_microbatches)
    if per_micro % n_batch:
        raise ConfigError(f"train.batch_size: {cfg.train.batch_size} sequences in "
                          f"{cfg.train.accumulation_steps} (accumulation) x "
                          f"{cfg.pipeline.stage_microbatches} (pipeline) "
                          f"micro-batches cannot be split over data x expert = {n_batch} devices"
                          + (" (mesh.context splits each sequence over devices instead)"
                             if per_micro < n_batch else ""))
    if cfg.num_moe_layers:
        check_expert_split(cfg.moe.num_experts, mesh.shape["expert"])
    if axis_size(mesh, "context") > 1:
        check_context_split(cfg, axis_size(mesh, "context"))
    S, W = mesh.shape["stage"], cfg.pipeline.virtual_stages
    if S > 1 and cfg.num_moe_layers < S * W:  # mesh.stage: -1 resolves only here
        raise ConfigError(f"mesh.stage: {cfg.num_moe_layers} MoE layers cannot fill {S} stages "
                          f"x {W} virtual stages")
    if (S > 1 and not uses_per_device_step(cfg) and cfg.num_moe_layers
            and Kernels.of_mesh(mesh).grouped_gemm(cfg.moe, cfg.model.d_model) == "cudnn"):
        # the global-array pipeline runs its stages under vmap, which cuDNN's kernels lack
        raise ConfigError("mesh.parallelism: MXFP8 experts on this GPU run cuDNN's grouped "
                          "GEMMs, which run per device: pipeline stages need ddp")
    if cfg.mesh.parallelism == "fsdp" and cfg.model.d_model % mesh.shape["data"]:
        raise ConfigError(f"model.d_model: {cfg.model.d_model} cannot be split over "
                          f"mesh.data={mesh.shape['data']} for fsdp")
    if (uses_per_device_step(cfg) and cfg.num_moe_layers and cfg.moe.dispatcher in LOCAL
            and mesh.shape["expert"] > 1):
        raise ConfigError(f"moe.dispatcher: {cfg.moe.dispatcher!r} runs every expert on "
                          f"each device, but mesh.expert={mesh.shape['expert']} splits "
                          "them; use alltoall, allgather or ragged")


def check_optimizer(cfg: Config, mesh: Mesh, abs_params: nnx.State, shard_specs: nnx.State) -> None:
    """The optimizer checks that need the model's parameters and the mesh; run
    before compiling. `shard_specs`: where each parameter's optimizer state lives."""
    o = cfg.optimizer
    unmatched = unmatched_patterns(abs_params, o.no_decay)
    if unmatched:
        raise ConfigError(f"optimizer.no_decay: {unmatched} match no parameter; the "
                          f"parameters' paths are {', '.join(param_names(abs_params))}")
    # The per-device step updates each device's part of a tensor on its own: right
    # only for an optimizer that updates every element from its own history.
    specs = jax.tree.leaves(shard_specs, is_leaf=lambda x: isinstance(x, P))
    split = any(mesh.shape[a] > 1 for spec in specs for entry in spec
                for a in sharding.spec_axes(entry))
    # (Muon's matrices are made whole by the step: `DeviceProgram.whole_matrices`)
    if uses_per_device_step(cfg) and split and o.name != "muon" and not updates_are_elementwise(o):
        raise ConfigError(f"optimizer.name: {o.name} takes statistics over whole tensors, but "
                          "the ddp step updates each device's part of a tensor (its ZeRO-1 "
                          "shard, its experts, its stage's layers) on its own; use "
                          "mesh.parallelism: fsdp, or an optimizer that updates each element "
                          "on its own (adamw, lion, sgd, ...)")
