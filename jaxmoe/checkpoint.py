"""Checkpoints through orbax's CheckpointManager: async, atomic, keep-last-K/every-N.

A checkpoint holds everything needed to continue bit-exactly: the whole
TrainState (params, optimizer state, router expert biases, step, RNG key) and a
JSON `meta` item (format version, the data iterator's position, the config).
The MoE layers are saved in model order whatever the pipeline layout they
trained under (a circular pipeline stores them by device, padded to equal
stages), so a checkpoint resumes under any mesh and pipeline layout, and
readers of the weights need no layout.
Orbax writes into a temporary directory and renames it when complete, so a
checkpoint exists only once whole; a process killed mid-save leaves the previous
one as the latest.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxmoe.config import SHAPE_KEYS, Config, config_from_dict, current_value
from jaxmoe.model.transformer import stored_layer_order
from jaxmoe.step import Steps, TrainState, abstract_model

# 3: MoE layers in model order, pipeline padding dropped; `train.accumulation_steps`
#    and `pipeline.stage_microbatches` in the config.
# 2: MoE layers in the saved config's pipeline layout (`stored_layer_order`); the
#    config said `microbatches` for both. Resumes: the layout is converted on read.
# 1: optax's chained (clip, adam, decay, schedule) states, which 2 cannot restore
#    into (2 holds jaxmoe.optim.AdamWState); its weights still load.
FORMAT_VERSION = 3
RESUMES_SINCE = 2
WEIGHTS_SINCE = 1  # params and router biases are laid out as in format 1


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
        state=ocp.args.StandardSave(to_model_order(state, cfg)), meta=ocp.args.JsonSave(meta)))


# ---------------------------------------------------------------- MoE layer layout

def _is_moe(path) -> bool:
    return any(getattr(k, "key", None) == "moe_layers" for k in path)


def _moe_length(tree) -> int | None:
    leaves = [a for p, a in jax.tree_util.tree_leaves_with_path(tree) if _is_moe(p)]
    return leaves[0].shape[0] if leaves else None


def _fit(sharding, length: int):
    """`sharding` for a leading axis of `length`: unsplit where it would not divide."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or not sharding.spec:
        return sharding
    head = sharding.spec[0]
    names = head if isinstance(head, tuple) else (head,) if head else ()
    if length % int(np.prod([sharding.mesh.shape[n] for n in names], dtype=int)) == 0:
        return sharding
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
        None, *sharding.spec[1:]))


def _take_layers(tree, source, shardings=None):
    """`tree` with each MoE leaf's layer axis rebuilt: slot i takes layer source[i],
    or zeros where source[i] < 0 (a pipeline's pass-through padding). One program
    for all leaves; `shardings`: the result's (a tree like `tree`), else the input's
    fitted to the new length."""
    source = np.asarray(source)
    if _moe_length(tree) is None or (len(source) == _moe_length(tree)
                                     and np.array_equal(source, np.arange(len(source)))):
        return tree
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    moe = [_is_moe(p) for p in paths]
    leaves = jax.tree.leaves(tree)
    if shardings is None:
        outs = [_fit(a.sharding, len(source)) for a, m in zip(leaves, moe) if m]
    else:
        outs = [s for s, m in zip(jax.tree.leaves(shardings), moe) if m]
    taken = iter(_taker(tuple(int(i) for i in source), tuple(outs))(
        [a for a, m in zip(leaves, moe) if m]))
    return jax.tree.unflatten(jax.tree.structure(tree),
                              [next(taken) if m else a for a, m in zip(leaves, moe)])


@functools.lru_cache(maxsize=8)
def _taker(source: tuple[int, ...], out_shardings: tuple) -> Callable:
    """The compiled gather of `_take_layers`, one per layout change (a run saves
    many times with the same one)."""
    index, pad = np.maximum(np.array(source), 0), np.array(source) < 0

    def take(arrays):
        return [jnp.where(pad.reshape((-1,) + (1,) * (a.ndim - 1)), jnp.zeros((), a.dtype),
                          a[index]) for a in arrays]

    return jax.jit(take, out_shardings=list(out_shardings))


def to_model_order(state, cfg: Config):
    """`state` (any tree holding `moe_layers` subtrees) with its MoE layers in model
    order, padding dropped: what a checkpoint holds. Costs one copy of the MoE
    state where the layout is not already model order (circular or padded
    pipelines only); a save runs between steps, when the step's activations,
    larger than that copy, are free."""
    order = stored_layer_order(cfg)
    return _take_layers(state, np.argsort(order)[: cfg.num_moe_layers])


def _saved_order(meta: dict) -> np.ndarray:
    """Model-order index of each saved MoE slot (>= the layer count: padding)."""
    cfg = saved_config(meta)
    if meta["format_version"] >= 3:
        return np.arange(cfg.num_moe_layers)
    return stored_layer_order(cfg)


def _from_saved(saved_order: np.ndarray, order: np.ndarray, num_layers: int) -> np.ndarray:
    """For each slot of the layout `order`, the saved slot holding its layer (-1: padding)."""
    saved_slot = {int(m): j for j, m in enumerate(saved_order) if m < num_layers}
    return np.array([saved_slot.get(int(m), -1) for m in order])


def saved_config(meta: dict) -> Config:
    """The config a checkpoint was saved under, in this jaxmoe's keys."""
    raw = meta["config"]
    if meta["format_version"] < 3:  # one key, two meanings, renamed since
        raw = {**raw, "train": dict(raw.get("train", {})),
               "pipeline": dict(raw.get("pipeline", {}))}
        if "microbatches" in raw["train"]:
            raw["train"]["accumulation_steps"] = raw["train"].pop("microbatches")
        if "microbatches" in raw["pipeline"]:
            raw["pipeline"]["stage_microbatches"] = raw["pipeline"].pop("microbatches")
    return config_from_dict(raw)


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
    if version < RESUMES_SINCE and not weights_only:
        raise CheckpointError(f"checkpoint {directory / str(step)} has format version {version}, "
                              f"whose optimizer state this jaxmoe (format {FORMAT_VERSION}) cannot "
                              f"restore; its weights still load (jaxmoe.load_params, "
                              f"python -m jaxmoe.export)")
    return step, meta


def check_compatible(saved: dict, cfg: Config, where: Path) -> None:
    """Rejects resuming with a model whose shapes differ from the checkpoint's, or
    with another optimizer (the mesh and pipeline layout may differ, and so may
    optimizer.mu_dtype: orbax casts the first moment as it reads it)."""
    current = cfg.to_dict()
    diffs = [f"{sec}.{key}: checkpoint {saved[sec].get(key)!r}, config {current[sec][key]!r}"
             for sec, keys in SHAPE_KEYS.items() for key in keys
             if current_value(f"{sec}.{key}", saved.get(sec, {}).get(key)) != current[sec][key]]
    # another optimizer holds another state (checkpoints without the key are adamw's;
    # "lion" and "optax.lion" are one optimizer, "optax.adamw" is not jaxmoe's adamw)
    def optimizer(name: str) -> str:
        return name if name == "adamw" else "optax." + name.removeprefix("optax.")

    saved_optimizer = saved.get("optimizer", {}).get("name", "adamw")
    if optimizer(saved_optimizer) != optimizer(cfg.optimizer.name):
        diffs.append(f"optimizer.name: checkpoint {saved_optimizer!r}, config "
                     f"{cfg.optimizer.name!r}")
    if diffs:
        raise CheckpointError(f"checkpoint {where} was made for another model shape or "
                              "optimizer: " + "; ".join(diffs))


def abstract_target(steps: Steps) -> TrainState:
    """Shapes, dtypes and this mesh's shardings: orbax restores (and reshards) into it."""
    shapes = jax.eval_shape(steps.init, jax.random.PRNGKey(0))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, steps.state_shardings)


def restore(directory: str | Path, steps: Steps, step: int | None = None) -> tuple[TrainState, dict]:
    """Restores the latest (or given) checkpoint into `steps`' mesh and shardings.

    Returns the state and the data iterator's state. The checkpoint may come
    from another mesh or pipeline layout: orbax reads each device's slice for the
    new shardings, and the MoE layers are then put in the new layout's order.
    """
    directory = Path(directory)
    step, meta = read_meta(directory, step)
    check_compatible(meta["config"], steps.cfg, directory / str(step))
    target = abstract_target(steps)
    saved_order = _saved_order(meta)
    as_saved = jax.tree_util.tree_map_with_path(
        lambda p, a: jax.ShapeDtypeStruct((len(saved_order),) + a.shape[1:], a.dtype,
                                          sharding=_fit(a.sharding, len(saved_order)))
        if _is_moe(p) else a, target)
    state = _read_state(directory, step, ocp.args.StandardRestore(as_saved))
    source = _from_saved(saved_order, stored_layer_order(steps.cfg), steps.cfg.num_moe_layers)
    shardings = jax.tree.map(lambda a: a.sharding, target)
    return _take_layers(state, source, shardings), meta["data"]


def restore_weights(directory: str | Path, step: int | None = None) -> tuple[nnx.State, Config]:
    """Parameters and router biases of a checkpoint on one device, MoE layers in
    model order (whatever the layout they trained under), with the config they
    were saved under. Reads neither the optimizer state nor anything compiled,
    so it needs a third of `restore`'s memory and works on older formats."""
    directory = Path(directory)
    step, meta = read_meta(directory, step, weights_only=True)
    cfg = saved_config(meta)
    saved_order = _saved_order(meta)
    _, abs_params, abs_buffers = abstract_model(cfg)
    one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    wanted = jax.tree_util.tree_map_with_path(
        lambda p, a: jax.ShapeDtypeStruct(((len(saved_order),) + a.shape[1:]) if _is_moe(p)
                                          else a.shape, a.dtype, sharding=one_device),
        {"params": abs_params, "buffers": abs_buffers})
    weights = _read_state(directory, step, ocp.args.PyTreeRestore(
        wanted, ocp.checkpoint_utils.construct_restore_args(wanted), partial_restore=True))
    weights = _take_layers(weights, np.argsort(saved_order)[: cfg.num_moe_layers])
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
