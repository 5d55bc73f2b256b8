"""Weights from outside a run (a checkpoint's, a Hugging Face import's) placed into the
steps' state, their shapes checked against the config.
"""

from __future__ import annotations


import jax
import numpy as np
from flax import nnx

from jaxmoe.step.build import Steps, TrainState, abstract_model


def with_weights(steps: Steps, state: TrainState, weights: dict) -> TrainState:
    """`state` with these weights (see `place_weights`). The optimizer state stays."""
    params, buffers = place_weights(steps, weights)
    return state._replace(params=params, buffers=buffers)


def place_weights(steps: Steps, weights: dict) -> tuple[nnx.State, nnx.State]:
    """(params, buffers) of a plain dict of weights in model order, router biases
    included (what `jaxmoe.load_params` and `jaxmoe.hf.load_hf` give), stored as the
    layout keeps them and placed on the mesh: what the steps take."""
    _, params, buffers = abstract_model(steps.cfg)
    params.replace_by_pure_dict(_only(weights, params.to_pure_dict()))
    buffers.replace_by_pure_dict(_only(weights, buffers.to_pure_dict()))
    shardings, stored = steps.state_shardings, steps.program.stored  # on the host
    return (jax.device_put(stored(params), shardings.params),
            jax.device_put(stored(buffers), shardings.buffers))


def check_shapes(got, want, label: str, extra: bool = False) -> None:
    """Raises ValueError naming the first leaf of `got` missing from `want`'s tree, not
    in it (unless `extra` leaves are allowed) or of another shape; `label` names `got`."""
    def shape(a):  # abstract arrays too
        return tuple(a.shape) if hasattr(a, "shape") else np.shape(a)

    want_shapes = {jax.tree_util.keystr(p): shape(a)
                   for p, a in jax.tree_util.tree_leaves_with_path(want)}
    try:
        got_shapes = {jax.tree_util.keystr(p): shape(a)
                      for p, a in jax.tree_util.tree_leaves_with_path(got)}
    except TypeError as e:
        raise ValueError(f"{label}: not a pytree of arrays ({e})") from None
    for key in sorted(want_shapes.keys() | got_shapes.keys()):
        if key not in got_shapes:
            raise ValueError(f"{label}{key}: missing for this config")
        if key not in want_shapes:
            if extra:
                continue
            raise ValueError(f"{label}{key}: not part of a model with this config")
        if got_shapes[key] != want_shapes[key]:
            raise ValueError(f"{label}{key}: shape {got_shapes[key]} does not match the "
                             f"config's {want_shapes[key]}")


def _only(weights: dict, like: dict) -> dict:
    """The entries of `weights` that `like` has (params or buffers), shapes checked,
    as float32 arrays."""
    check_shapes(weights, like, "weights", extra=True)
    got = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_leaves_with_path(weights)}
    return jax.tree_util.tree_map_with_path(
        lambda path, _: np.asarray(got[jax.tree_util.keystr(path)], np.float32), like)
