"""Checkpoints through orbax's CheckpointManager: async, atomic, keep-last-K.

A checkpoint holds the whole TrainState (params, optimizer state, router
biases, step, RNG key), the data iterator's position and the config it was
made with.
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

from jaxmoe.config import Config
from jaxmoe.step import TrainState


def checkpoint_manager(run_dir: str | Path, cfg: Config) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.checkpoint.keep, create=True,
                                           enable_async_checkpointing=True)
    return ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options)


def save(manager: ocp.CheckpointManager, state: TrainState, data_state: dict, cfg: Config) -> None:
    """Starts an asynchronous save; orbax commits it atomically when complete."""
    step = int(state.step)
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(cfg.to_dict()),
    ))


def restore(manager: ocp.CheckpointManager, target: TrainState, step: int | None = None
            ) -> tuple[TrainState, dict]:
    """Restores the state into `target`'s shardings (abstract arrays with shardings
    or real arrays) and returns it with the data iterator's state."""
    step = manager.latest_step() if step is None else step
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    return restored["state"], restored["data"]
