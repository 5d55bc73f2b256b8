"""Checkpoints through orbax's CheckpointManager: async, atomic, keep-last-K/every-N.

A checkpoint holds everything needed to continue bit-exactly: the whole
TrainState (params, optimizer state, router expert biases, step, RNG key) and a
JSON `meta` item (format version, the data iterator's position, the config, and
how the MoE stack was held). The state is saved as the layout keeps it: the MoE
stack as [Lm, ...], or by pipeline stage as [V, S, per, ...] (`StageStack`),
which flattens to model order. Restoring under another mesh or pipeline layout
reshapes it (and drops or adds the padding); readers of the weights get model
order. Orbax writes into a temporary directory and renames it when complete, so
a checkpoint exists only once whole; a process killed mid-save leaves the
previous one as the latest.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmoe.config import SHAPE_KEYS, Config, config_from_dict, current_value
from jaxmoe.model.transformer import in_moe_stack, map_moe_stack
from jaxmoe.parallel.pipeline import StageStack
from jaxmoe.step import Steps, TrainState, abstract_model

# 4: the state as the layout keeps it, meta["moe_stack"] = [V, S, per] of a pipeline's
#    stage-held stack (None: [Lm, ...]).
# 3: MoE layers in model order, pipeline padding dropped; `train.accumulation_steps`
#    and `pipeline.stage_microbatches` in the config.
# 2: MoE layers in the saved config's pipeline layout, stage-major ([S, V, per]
#    flattened); the config said `microbatches` for both. Resumes: read into model order.
# 1: optax's chained (clip, adam, decay, schedule) states, which 2 cannot restore
#    into (2 holds jaxmoe.optim.AdamWState); its weights, laid out as 2's, still load.
FORMAT_VERSION = 4
RESUMES_SINCE = 2
WEIGHTS_SINCE = 1  # the oldest format whose params and router biases load


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which and why."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir).absolute() / "checkpoints"


def checkpoint_manager(run_dir: str | Path, cfg: Config) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.checkpoint.keep, keep_period=cfg.checkpoint.keep_every or None,
        create=True, enable_async_checkpointing=True)
    return ocp.CheckpointManager(checkpoint_dir(run_dir), options=options)


def save(manager: ocp.CheckpointManager, state: TrainState, data_state: dict,
         steps: Steps) -> None:
    """Starts an asynchronous save of the state at its step; training goes on."""
    stack = steps.layout.stack
    meta = {"format_version": FORMAT_VERSION, "data": data_state, "config": steps.cfg.to_dict(),
            "moe_stack": None if stack is None else list(stack)}
    manager.save(int(state.step), args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


# ---------------------------------------------------------------- the saved MoE stack


class _Saved:
    """How a checkpoint holds its MoE stack, and the way back to model order."""

    def __init__(self, meta: dict):
        cfg = saved_config(meta)
        self.num_layers = cfg.num_moe_layers
        version = meta["format_version"]
        self.stack = StageStack(*meta["moe_stack"]) if version >= 4 and meta["moe_stack"] else None
        self.format2_slots = None
        if version < 3 and max(cfg.mesh.stage, 1) > 1:  # formats 1 and 2
            self.format2_slots = _format2_slots(cfg)

    def layer_dims(self) -> tuple[int, ...]:
        """The leading (layer) dimensions of each saved MoE leaf."""
        if self.stack is not None:
            return (self.stack.virtual, self.stack.stages, self.stack.per)
        if self.format2_slots is not None:
            return (len(self.format2_slots),)
        return (self.num_layers,)

    def in_model_order(self, a):
        if self.stack is not None:
            return self.stack.model(a, self.num_layers)
        if self.format2_slots is not None:
            return a[np.argsort(self.format2_slots)[: self.num_layers]]
        return a


def _format2_slots(cfg: Config) -> np.ndarray:
    """Format 2's stage-major order: slot s V per + v per + j held model layer
    (v S + s) per + j of a stack padded to S V per slots."""
    S, V = max(cfg.mesh.stage, 1), cfg.pipeline.virtual_stages
    per = -(-cfg.num_moe_layers // (S * V))
    s, v, j = np.meshgrid(np.arange(S), np.arange(V), np.arange(per), indexing="ij")
    return ((v * S + s) * per + j).reshape(-1)


def _layered(target, layer_dims: tuple[int, ...]):
    """Bool tree: which leaves of `target` stack the MoE layers on their leading
    `layer_dims` (not, e.g., a factored optimizer statistic or a step count)."""
    def each(path, a):
        return in_moe_stack(path) and tuple(a.shape[:len(layer_dims)]) == layer_dims
    return jax.tree_util.tree_map_with_path(each, target)


def _as_saved(target, layered, saved: _Saved, new_dims: int):
    """`target` (abstract, placed) with each layered MoE leaf shaped as saved, the
    rest of its dimensions placed as the target places them. The saved layer
    dimensions are split over `stage` where they divide (each stage device reads a
    part, not the whole stack), else read whole."""
    dims = saved.layer_dims()

    def leaf(is_layered, a):
        if not is_layered:
            return a
        mesh = a.sharding.mesh
        rest = (tuple(a.sharding.spec) + (None,) * a.ndim)[new_dims:a.ndim]
        S = mesh.shape["stage"]
        lead = (None,) * len(dims)
        if S > 1 and not any("stage" in ((r,) if isinstance(r, str) else r or ()) for r in rest):
            if len(dims) == 3 and dims[1] % S == 0:
                lead = (None, "stage", None)
            elif len(dims) == 1 and dims[0] % S == 0:
                lead = ("stage",)
        return jax.ShapeDtypeStruct(dims + a.shape[new_dims:], a.dtype,
                                    sharding=NamedSharding(mesh, P(*lead, *rest)))

    return jax.tree.map(leaf, layered, target)


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


def run_dir_of(path: str | Path) -> Path:
    """The run directory that holds a checkpoint (`locate`'s path forms)."""
    directory, _ = locate(path)
    return directory.parent if directory.name == "checkpoints" else directory


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
    new shardings; a MoE stack held another way is read in its saved shape (split
    over `stage` where that divides it) and each leaf reshaped into this layout's
    (a compiled reshape, pad or slice).
    """
    directory = Path(directory)
    step, meta = read_meta(directory, step)
    check_compatible(meta["config"], steps.cfg, directory / str(step))
    target = abstract_target(steps)
    saved, layout = _Saved(meta), steps.layout
    same = (saved.stack == layout.stack and saved.format2_slots is None) or (
        steps.cfg.num_moe_layers == 0)
    if same:
        return _read_state(directory, step, ocp.args.StandardRestore(target)), meta["data"]
    new_dims = (steps.cfg.num_moe_layers,) if layout.stack is None else tuple(layout.stack)
    layered = _layered(target, new_dims)
    state = _read_state(directory, step, ocp.args.StandardRestore(
        _as_saved(target, layered, saved, len(new_dims))))

    def to_layout(a):  # saved layer order -> model order -> this layout's
        a = saved.in_model_order(a)
        return a if layout.stack is None else layout.stack.stored(a)

    # leaf by leaf: the state is held about once, not read and converted side by side
    leaves, treedef = jax.tree.flatten(state)
    flags, places = jax.tree.leaves(layered), jax.tree.leaves(target)
    for i, (is_layered, place) in enumerate(zip(flags, places)):
        if is_layered:
            leaves[i] = jax.jit(to_layout, out_shardings=place.sharding)(leaves[i])
    return jax.tree.unflatten(treedef, leaves), meta["data"]


def restore_weights(directory: str | Path, step: int | None = None) -> tuple[nnx.State, Config]:
    """Parameters and router biases of a checkpoint on one device, MoE layers in
    model order (whatever the layout they trained under), with the config they
    were saved under. Reads neither the optimizer state nor anything compiled,
    so it needs a third of `restore`'s memory and works on older formats."""
    directory = Path(directory)
    step, meta = read_meta(directory, step, weights_only=True)
    cfg, saved = saved_config(meta), _Saved(meta)
    _, abs_params, abs_buffers = abstract_model(cfg)
    one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one_device),
                          {"params": abs_params, "buffers": abs_buffers})
    wanted = map_moe_stack(lambda a: jax.ShapeDtypeStruct(
        saved.layer_dims() + a.shape[1:], a.dtype, sharding=one_device), placed)
    weights = _read_state(directory, step, ocp.args.PyTreeRestore(
        wanted, ocp.checkpoint_utils.construct_restore_args(wanted), partial_restore=True))
    weights = map_moe_stack(lambda a: np.asarray(saved.in_model_order(a)), weights)
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
