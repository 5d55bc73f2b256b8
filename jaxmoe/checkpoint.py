"""Checkpoints through orbax's CheckpointManager: async, atomic, keep-last-K/every-N.

A checkpoint holds everything needed to continue bit-exactly: the whole
TrainState (params, optimizer state, router expert biases, step, RNG key) and a
JSON `meta` item (format version, the data iterator's position, the config).
Orbax writes into a temporary directory and renames it when complete, so a
checkpoint exists only once whole; a process killed mid-save leaves the previous
one as the latest.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxmoe.config import Config, config_from_dict
from jaxmoe.model.transformer import stored_layer_order
from jaxmoe.step import Steps, TrainState, abstract_model

# 2: optimizer state is jaxmoe.optim.AdamWState (count, mu, nu); 1 held optax's
# chained (clip, adam, decay, schedule) states, which 2 cannot restore into.
FORMAT_VERSION = 2
WEIGHTS_SINCE = 1  # params and router biases are laid out as in format 1
# Keys whose change alters parameter or optimizer-state shapes.
SHAPE_KEYS = {
    "model": ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "mlp_hidden", "num_dense_layers", "qk_norm"),
    "moe": ("num_experts", "expert_hidden", "shared_expert_hidden", "expert_bias"),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which and why."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir).absolute() / "checkpoints"


def checkpoint_manager(run_dir: str | Path, cfg: Config) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.checkpoint.keep, keep_period=cfg.checkpoint.keep_every or None,
        create=True, enable_async_checkpointing=True)
    return ocp.CheckpointManager(checkpoint_dir(run_dir), options=options)


def save(manager: ocp.CheckpointManager, state: TrainState, data_state: dict, cfg: Config) -> None:
    """Starts an asynchronous save of the state at its step; training goes on."""
    meta = {"format_version": FORMAT_VERSION, "data": data_state, "config": cfg.to_dict()}
    manager.save(int(state.step), args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


def locate(path: str | Path) -> tuple[Path, int | None]:
    """A run directory, its checkpoints/ directory or one step's directory ->
    (checkpoints directory, step or None for the latest)."""
    directory = Path(path).absolute()  # orbax refuses relative paths
    if (directory / "checkpoints").is_dir():
        return directory / "checkpoints", None
    if directory.name.isdigit():
        return directory.parent, int(directory.name)
    return directory, None


def complete_steps(directory: str | Path) -> list[int]:
    """Steps with a committed checkpoint (orbax's temporary directories excluded)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def read_meta(directory: str | Path, step: int | None = None,
              weights_only: bool = False) -> tuple[int, dict]:
    """(step, meta) of the latest (or given) complete checkpoint; checks the format
    (older formats are readable when only the weights are wanted)."""
    directory = Path(directory)
    steps = complete_steps(directory)
    if not steps:
        raise CheckpointError(f"no complete checkpoint in {directory}")
    step = steps[-1] if step is None else step
    path = directory / str(step) / "meta" / "metadata"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {directory / str(step)} is corrupt: cannot read "
                              f"its metadata ({type(e).__name__})") from None
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {directory / str(step)} has format version {version}; "
                              f"this jaxmoe reads up to {FORMAT_VERSION} (upgrade jaxmoe)")
    if version < WEIGHTS_SINCE:
        raise CheckpointError(f"checkpoint {directory / str(step)} has format version {version}, "
                              f"older than any this jaxmoe reads ({WEIGHTS_SINCE})")
    if version < FORMAT_VERSION and not weights_only:
        raise CheckpointError(f"checkpoint {directory / str(step)} has format version {version}, "
                              f"whose optimizer state this jaxmoe (format {FORMAT_VERSION}) cannot "
                              f"restore; its weights still load (jaxmoe.load_params, "
                              f"python -m jaxmoe.export)")
    return step, meta


def check_compatible(saved: dict, cfg: Config, where: Path) -> None:
    """Rejects resuming with a model whose shapes differ from the checkpoint's."""
    current = cfg.to_dict()
    diffs = [f"{sec}.{key}: checkpoint {saved[sec].get(key)!r}, config {current[sec][key]!r}"
             for sec, keys in SHAPE_KEYS.items() for key in keys
             if saved.get(sec, {}).get(key) != current[sec][key]]
    # pipelines store MoE layers by stage, padded to equal stages: the layout must match too
    if not diffs and not np.array_equal(stored_layer_order(config_from_dict(saved)),
                                        stored_layer_order(cfg)):
        layout = lambda c: (c["mesh"]["stage"], c["pipeline"]["virtual_stages"])  # noqa: E731
        diffs.append(f"(mesh.stage, pipeline.virtual_stages): checkpoint {layout(saved)}, "
                     f"config {layout(current)} (pipelines store MoE layers by stage, padded "
                     "to equal stages)")
    if diffs:
        raise CheckpointError(f"checkpoint {where} was made for another model shape: "
                              + "; ".join(diffs))


def abstract_target(steps: Steps) -> TrainState:
    """Shapes, dtypes and this mesh's shardings: orbax restores (and reshards) into it."""
    shapes = jax.eval_shape(steps.init, jax.random.PRNGKey(0))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, steps.state_shardings)


def restore(directory: str | Path, steps: Steps, step: int | None = None) -> tuple[TrainState, dict]:
    """Restores the latest (or given) checkpoint into `steps`' mesh and shardings.

    Returns the state and the data iterator's state. The checkpoint may come
    from another mesh: orbax reads each device's slice for the new shardings.
    """
    directory = Path(directory)
    step, meta = read_meta(directory, step)
    check_compatible(meta["config"], steps.cfg, directory / str(step))
    state = _read_state(directory, step, ocp.args.StandardRestore(abstract_target(steps)))
    return state, meta["data"]


def restore_weights(directory: str | Path, step: int | None = None) -> tuple[nnx.State, Config]:
    """Parameters and router biases of a checkpoint on one device, in their saved
    layer layout (pipelines store MoE layers by stage, maybe padded: see
    `stored_layer_order`), with the config they were saved under. Reads neither
    the optimizer state nor anything compiled, so it needs a third of `restore`'s
    memory and works on older formats."""
    directory = Path(directory)
    step, meta = read_meta(directory, step, weights_only=True)
    cfg = config_from_dict(meta["config"])
    _, abs_params, abs_buffers = abstract_model(cfg)
    one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    wanted = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one_device),
                          {"params": abs_params, "buffers": abs_buffers})
    weights = _read_state(directory, step, ocp.args.PyTreeRestore(
        wanted, ocp.checkpoint_utils.construct_restore_args(wanted), partial_restore=True))
    return nnx.merge_state(weights["params"], weights["buffers"]), cfg


def _read_state(directory: Path, step: int, args):
    """The saved state item, read through `args`; damage becomes a CheckpointError.

    Damaged files surface from orbax as OSError (missing files), ValueError (bad
    JSON) or a bare Exception (TensorStore read errors); any other type is a bug
    and propagates as itself.
    """
    directory = Path(directory).absolute()
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        read_only=True, create=False))
    try:
        return manager.restore(step, args=ocp.args.Composite(state=args))["state"]
    except Exception as e:
        if not (isinstance(e, (OSError, ValueError)) or type(e) is Exception):
            raise
        raise CheckpointError(f"checkpoint {directory / str(step)} is corrupt or unreadable: "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    finally:
        manager.close()
