"""Checkpoints through orbax's CheckpointManager: async, atomic, keep-last-K/every-N.

A checkpoint holds everything needed to continue bit-exactly: the whole
TrainState (params, optimizer state, router expert biases, step, RNG key) and a
JSON `meta` item (format version, the data iterator's position, the config, and
how the MoE stack was held). The state is saved as the layout keeps it: the MoE
stack as [Lm, ...], or by pipeline stage as [W, S, per, ...] (`StageStack`),
which flattens to model order. Restoring under another mesh or pipeline layout
reshapes it (and drops or adds the padding); readers of the weights get model
order. Orbax writes into a temporary directory and renames it when complete, so
a checkpoint exists only once whole; a process killed mid-save leaves the
previous one as the latest.

Faults lose nothing and say one line. A save that fails (no space, permission,
I/O) stops the run at once (`Saver`), its partial directory removed, the last
complete checkpoint kept. A checkpoint that does not read back whole is skipped
for the newest older one that does (`newest_readable`), with a line naming it and
what is wrong; it is never deleted, and a resumed run sets it aside under another
name (`set_aside`) so that new saves neither collide with it nor count it among
the checkpoints they keep.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmoe.config import SHAPE_KEYS, Config, config_from_dict, current_value
from jaxmoe.model.transformer import in_moe_stack, map_moe_stack
from jaxmoe.parallel.pipeline import StageStack
from jaxmoe.parallel.sharding import spec_axes
from jaxmoe.step import Steps, TrainState, abstract_model

# 4: the state as the layout keeps it, meta["moe_stack"] = [W, S, per] of a pipeline's
#    stage-held stack (None: [Lm, ...]).
# 3: MoE layers in model order, pipeline padding dropped; `train.accumulation_steps`
#    and `pipeline.stage_microbatches` in the config.
# 2: MoE layers in the saved config's pipeline layout, stage-major ([S, W, per]
#    flattened); the config said `microbatches` for both. Resumes: read into model order.
# 1: optax's chained (clip, adam, decay, schedule) states, which 2 cannot restore
#    into (2 holds jaxmoe.optim.adamw.AdamWState); its weights, laid out as 2's, still load.
FORMAT_VERSION = 4
RESUMES_SINCE = 2
WEIGHTS_SINCE = 1  # the oldest format whose params and router biases load


class CheckpointError(ValueError):
    """A checkpoint that cannot be used or saved; the message says which and why."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files do not read back: missing, truncated, corrupt."""


T = TypeVar("T")


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
    stack = steps.program.stack
    meta = {"format_version": FORMAT_VERSION, "data": data_state, "config": steps.cfg.to_dict(),
            "moe_stack": None if stack is None else list(stack)}
    manager.save(int(state.step), args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


class Saver:
    """A run's saves: orbax's asynchronous, atomic saves that end the run at the first
    failure. Orbax reports a failed background save only in its logs (a traceback per
    thread) and raises it at a later save; here its first error is kept and the log
    records dropped, and `check` (each step), `save` and `finish` raise it as one
    CheckpointError naming the step, the directory and the reason, once the partial
    directory is removed."""

    def __init__(self, run_dir: str | Path, cfg: Config):
        self.manager = checkpoint_manager(run_dir, cfg)
        self.directory = checkpoint_dir(run_dir)
        self.pending: int | None = None  # the step of the save in flight
        self.error: str | None = None  # the save's failure, once one is seen
        self.errors: list[str] = []  # every error its writers reported, in order
        logging.getLogger("absl").addFilter(self._capture)
        _quiet_failed_io()

    def _capture(self, record: logging.LogRecord) -> bool:
        """Keeps orbax's first error (from any thread) and drops its log records."""
        if record.levelno < logging.ERROR or "orbax" not in record.pathname:
            return True
        reason = str(record.exc_info[1]) if record.exc_info else record.getMessage()
        self._failed(reason.strip() or "unknown error")
        return False

    def save(self, state: TrainState, data_state: dict, steps: Steps) -> None:
        self.check()
        try:
            save(self.manager, state, data_state, steps)
        except Exception as e:  # noqa: BLE001: a synchronous failure of the same save
            self._failed(f"{type(e).__name__}: {e}")
        self.pending = int(state.step)
        self.check()

    def save_good(self, state: TrainState, data_state: dict, steps: Steps) -> bool:
        """Saves `state` unless its weights gave the step that made it a non-finite loss
        or gradient (that step was skipped: `state.bad_steps` counts the streak), so no
        checkpoint is saved from inside a divergence; False if not saved."""
        if int(state.bad_steps):
            return False
        self.save(state, data_state, steps)
        return True

    def _failed(self, error: str) -> None:
        if len(self.errors) < 64:  # the failed save's writers may each report
            self.errors.append(error)
        self.error = self.error or error

    def check(self) -> None:
        """Raises if a save has failed; a finished save whose step is missing failed."""
        if self.pending is not None and self.error is None and \
                not self.manager.is_saving_in_progress():
            if self.pending not in complete_steps(self.directory):
                self.error = "the save did not complete"
            else:
                self.pending = None
        if self.error is not None:
            self._fail()

    def finish(self) -> None:
        """Waits for the save in flight; raises if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001: orbax re-raises its background failure
            self._failed(f"{type(e).__name__}: {e}")
        self.check()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps() or [])

    def close(self) -> None:
        logging.getLogger("absl").removeFilter(self._capture)

    def __enter__(self) -> Saver:
        return self

    def __exit__(self, kind, error, tb) -> None:
        """However the run leaves: the save in flight completes (a failed one raises),
        unless a save's failure is what ends it (its writers are past already, and the
        log filter stays, so the run ends with that one error)."""
        if self.error is not None:
            return
        try:
            self.finish()
        finally:
            self.close()

    def _fail(self):
        # the failed save's other writers end first (their errors, logged, dropped);
        # the filter stays: the run ends with this error
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001: the same failure, raised again
            self._failed(f"{type(e).__name__}: {e}")
        try:  # the wait returns at the first failure; closing joins every writer
            self.manager.close()
        except Exception as e:  # noqa: BLE001: the same failure, raised again
            self._failed(f"{type(e).__name__}: {e}")
        _remove_partials(self.directory)
        kept = [s for s in complete_steps(self.directory) if s != self.pending]
        reason = _reason(self.errors or [self.error])
        raise CheckpointError(
            f"saving checkpoint {self.pending} in {self.directory} failed: {reason}; "
            + (f"the last complete one, step {kept[-1]}, is kept" if kept else
               "there is no complete checkpoint"))


def _remove_partials(directory: Path, settle_s: float = 0.2, rounds: int = 25) -> None:
    """Removes a failed save's temporary directories until none comes back within
    `settle_s` (a writer still winding down may create one after a first removal)."""
    import time
    for _ in range(rounds):
        partials = list(directory.glob("*.orbax-checkpoint-tmp*"))
        for partial in partials:
            shutil.rmtree(partial, ignore_errors=True)
        time.sleep(settle_s)
        if not partials and not any(directory.glob("*.orbax-checkpoint-tmp*")):
            return


def _reason(errors: list[str]) -> str:
    """The operating system's words where one of a failed save's errors holds them (a
    write that found no space: TensorStore's message has "...: No space left on device
    [os_error_code='28']", sometimes followed by more), else the first error's first
    line. Its writers fail in any order, and not every message names the cause."""
    import os
    import re
    for error in errors:
        found = re.findall(r": ([^:\[\]\n]*?) \[os_error_code='(\d+)'\]", error)
        if found:
            words, code = found[-1]
            return f"{words} (errno {code})"
    for error in errors:  # the system's words without the code
        for code in range(1, 134):
            if f": {os.strerror(code)}" in error:
                return f"{os.strerror(code)} (errno {code})"
    first = next((e.strip() for e in errors if e and e.strip()), "")
    return first.splitlines()[0][:300] if first else "unknown error"


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
    """Format 2's order: the stack's stage-major slots (`StageStack.stage_major`)."""
    return StageStack.of(cfg.num_moe_layers, max(cfg.mesh.stage, 1),
                         cfg.pipeline.virtual_stages).stage_major()


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
        if S > 1 and not any("stage" in spec_axes(r) for r in rest):
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


def newest_readable(directory: str | Path, read: Callable[[int], T], step: int | None = None,
                    fall_back: bool = True, agree: Callable[[bool], bool] = bool
                    ) -> tuple[int, T, list[tuple[int, str]]]:
    """(step, read(step), the damaged steps skipped with why): `read` of the newest
    complete checkpoint that reads back, or of `step` (no falling back from a step
    asked for). A damaged one (`read` raises CheckpointDamaged) is skipped with a line
    on stderr naming it and what is wrong, unless `fall_back` is off; `agree` makes
    every process skip the same ones (`distributed.any_process`)."""
    directory = Path(directory)
    candidates = [step] if step is not None else complete_steps(directory)[::-1]
    if not candidates:
        raise CheckpointError(f"no complete checkpoint in {directory}")
    damaged = []
    for s in candidates:
        try:
            result, failed = read(s), None
        except CheckpointDamaged as e:
            result, failed = None, e
        if not agree(failed is not None):
            for bad, why in damaged:  # said once per process, whoever reads it again
                if (key := str((directory / str(bad)).absolute())) not in _SKIPPED:
                    _SKIPPED.add(key)
                    print(f"skipping {why}", file=sys.stderr)
            return s, result, damaged
        if failed is None:
            failed = CheckpointDamaged(f"checkpoint {directory / str(s)} failed to read on "
                                       "another process")
        if step is not None or not fall_back or len(candidates) == 1:
            raise failed
        damaged.append((s, str(failed)))
    raise CheckpointError(f"no checkpoint in {directory} reads back: "
                          + "; ".join(why for _, why in damaged))


_SKIPPED: set[str] = set()


def set_aside(directory: str | Path, step: int, why: str = "damaged") -> Path:
    """Renames a checkpoint out of the steps' names (`STEP.damaged`, `STEP.diverged`,
    then `.damaged-2`, ...): kept, and no longer a step to resume from, for a save to
    collide with or for the manager to count among those it keeps."""
    directory = Path(directory)
    target, n = directory / f"{step}.{why}", 1
    while target.exists():
        n += 1
        target = directory / f"{step}.{why}-{n}"
    (directory / str(step)).rename(target)
    return target


def read_meta(directory: str | Path, step: int | None = None, weights_only: bool = False,
              fall_back: bool = True) -> tuple[int, dict]:
    """(step, meta) of the newest complete checkpoint whose metadata reads (or of the
    given one; `fall_back` off: of the newest, damaged or not); checks the format
    (older formats are readable when only the weights are wanted)."""
    directory = Path(directory)
    if step is None:  # the newest whose metadata reads
        step, (_, meta), _ = newest_readable(
            directory, lambda s: read_meta(directory, s, weights_only), fall_back=fall_back)
        return step, meta
    path = directory / str(step) / "meta" / "metadata"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(f"checkpoint {directory / str(step)} is corrupt: cannot read "
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
        return name if name in ("adamw", "muon") else "optax." + name.removeprefix("optax.")

    saved_optimizer = saved.get("optimizer", {}).get("name", "adamw")
    if optimizer(saved_optimizer) != optimizer(cfg.optimizer.name):
        diffs.append(f"optimizer.name: checkpoint {saved_optimizer!r}, config "
                     f"{cfg.optimizer.name!r} (the saved optimizer state is "
                     f"{saved_optimizer}'s; to go on from the weights with "
                     f"{cfg.optimizer.name}'s state new, start another run from them: "
                     "train(cfg, corpus, init_weights=jaxmoe.load_params(RUN)[0]))")
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
    saved, layout = _Saved(meta), steps.program
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


def resume(directory: str | Path, steps: Steps, fall_back: bool = True,
           agree: Callable[[bool], bool] = bool) -> tuple[TrainState, dict, int, list]:
    """(state, data state, step, the damaged steps skipped): `restore` of the newest
    checkpoint that reads back whole (`newest_readable`)."""
    step, (state, data), damaged = newest_readable(
        directory, lambda s: restore(directory, steps, s), fall_back=fall_back, agree=agree)
    return state, data, step, damaged


def load_weights(directory: str | Path, step: int | None = None
                 ) -> tuple[nnx.State, Config, int, dict]:
    """(weights, config, step, meta) of the newest checkpoint whose weights read back
    (or of `step`): `restore_weights`, for the readers of a run (`export`, `eval`,
    `load_params`)."""
    def read(s):
        return (*restore_weights(directory, s), read_meta(directory, s, weights_only=True)[1])

    step, (weights, cfg, meta), _ = newest_readable(directory, read, step)
    return weights, cfg, step, meta


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
    JSON, DATA_LOSS from TensorStore), KeyError (a missing item) or a bare
    Exception (TensorStore read errors); any other type is a bug and propagates as
    itself.
    """
    directory = Path(directory).absolute()
    _quiet_failed_io()
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        read_only=True, create=False))
    try:
        return manager.restore(step, args=ocp.args.Composite(state=args))["state"]
    except Exception as e:
        if not (isinstance(e, (OSError, ValueError, KeyError)) or type(e) is Exception):
            raise
        what = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        raise CheckpointDamaged(f"checkpoint {directory / str(step)} is corrupt or unreadable: "
                                f"{type(e).__name__}: {_first_line(what)}") from None
    finally:
        manager.close()


def _first_line(message: str) -> str:
    """A message's first line, with TensorStore's spec repr ("See full TensorStore
    details: <bound method ...>") cut off."""
    line = (message.strip().splitlines() or [""])[0]
    return line.split(" See full TensorStore details")[0][:200]


_QUIETED = threading.Lock()


def _quiet_failed_io() -> None:
    """Once per process: the echoes of a failed read or write drop out of stderr.
    After a damaged file fails a read (or a full disk a write), TensorStore's
    callbacks still post to orbax's closed event loop ("RuntimeError: Event loop is
    closed", a traceback per array, as unraisable exceptions) and orbax's abandoned
    coroutines report themselves (through the asyncio logger, or as never awaited);
    the failure itself is reported once, as a CheckpointError."""
    if not _QUIETED.acquire(blocking=False):
        return
    hook, thread_hook, unraisable_hook = sys.excepthook, threading.excepthook, sys.unraisablehook

    def closed(e) -> bool:
        return isinstance(e, RuntimeError) and str(e) == "Event loop is closed"

    def on_error(kind, value, tb):
        if not closed(value):
            hook(kind, value, tb)

    def on_thread(args):
        if not closed(args.exc_value):
            thread_hook(args)

    def orbax(obj) -> bool:  # an orbax object, or one of its coroutines (named in its code)
        code = getattr(obj, "cr_code", None)
        return "orbax" in repr(obj) or (code is not None and "orbax" in code.co_filename)

    def on_unraisable(unraisable):  # TensorStore's callbacks report through it, without
        # object; orbax's read coroutines still running when the failure surfaced, with it
        if not (closed(unraisable.exc_value) or orbax(unraisable.object)):
            unraisable_hook(unraisable)

    def abandoned(record: logging.LogRecord) -> bool:  # asyncio's "... never retrieved"
        if "never retrieved" not in record.getMessage() or not record.exc_info:
            return True
        return not any(word in str(record.exc_info[1]) or word in repr(record.exc_info[1])
                       for word in ("TensorStore", "DATA_LOSS", "orbax", "Event loop is closed"))

    # the interpreter warns of a coroutine never awaited through this function, whose
    # argument is the coroutine itself: the writers orbax created but never started
    # after the failure drop out, anyone else's still warn
    unawaited = getattr(warnings, "_warn_unawaited_coroutine", None)

    def on_unawaited(coro):
        if not orbax(coro):
            unawaited(coro)

    sys.excepthook, threading.excepthook, sys.unraisablehook = on_error, on_thread, on_unraisable
    logging.getLogger("asyncio").addFilter(abandoned)
    if unawaited is not None:
        warnings._warn_unawaited_coroutine = on_unawaited
