"""moe.on_overflow: a step whose routed copies overflow the expert buffers loses none
of them with `rerun` (the update withheld, the batch run again at larger capacity),
stops with `raise`, and drops and counts them with `drop`; on 8 fake devices, ddp with
the experts split over `expert`."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from jaxmoe.config import config_from_dict
from jaxmoe.parallel.sharding import make_mesh
from jaxmoe.step import build_steps
from jaxmoe.step.overflow import Overflow, OverflowSteps, ladder

BASE = {
    "model": {"d_model": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "num_dense_layers": 1, "mlp_hidden": 64},
    # global balance scope: the loss does not depend on how the batch is split
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "capacity_factor": 1.25,
            "balance_scope": "global", "dispatcher": "alltoall", "on_overflow": "rerun"},
    "train": {"steps": 10, "batch_size": 16, "seq_len": 16},
    "optimizer": {"warmup_steps": 0, "learning_rate": 1e-2},
    "mesh": {"data": 2, "expert": 4},
}
# fp32 sums of a few thousand terms, in another order on one device: a relative
# rounding of n x 2^-24 at most, n ~ 2,000
RTOL = 2e3 * 2.0**-24


def _cfg(**moe):
    return config_from_dict({**BASE, "moe": {**BASE["moe"], **moe}})


def _skewed(steps, batch):
    """The seed's state with a zero router: every score ties, so top-k takes experts 0
    and 1 for every token, E / K = 4 times their uniform share; the experts' weights
    scaled up, so that what they add to a token outweighs the rounding of the rest."""
    state = steps.init(jax.random.PRNGKey(0))
    scale = {"router": 0.0, "experts": 10.0}
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: a * next((s for k, s in scale.items()
                                  if k in jax.tree_util.keystr(path)), 1.0), state.params)
    return state._replace(params=params), jax.device_put(batch, steps.batch_sharding)


@pytest.fixture(scope="module")
def batch():
    return np.random.default_rng(0).integers(0, 256, (16, 17), dtype=np.int32)


@pytest.fixture(scope="module")
def rerun(batch):
    steps = build_steps(_cfg(), make_mesh(_cfg().mesh))
    state, placed = _skewed(steps, batch)
    first_state, first = steps.train_step(state, placed)  # the common-case buffers alone
    run = OverflowSteps(steps)
    state, metrics = run(*_skewed(steps, batch))
    result = jax.device_get((first_state, first, state, metrics))
    _, again = run(state, jax.device_put(batch, steps.batch_sharding))  # where the last ended
    return result, run, jax.device_get(_skewed(steps, batch)[0]), jax.device_get(again)


def test_the_ladder_doubles_up_to_dropless():
    assert ladder(_cfg()) == [1.25, 2.5, 4.0]
    assert ladder(_cfg(capacity_factor=4.0)) == [4.0]
    assert ladder(_cfg(capacity_factor=3.0)) == [3.0, 4.0]


def test_an_overflowed_step_changes_nothing(rerun):
    (first_state, first, _, _), _, initial, _ = rerun
    # the skewed input does overflow the common-case buffers
    assert first["overflowed"] == 1 and first["drop_fraction"].max() > 0.5
    assert first_state.step == initial.step == 0
    jax.tree.map(np.testing.assert_array_equal, first_state.params, initial.params)
    jax.tree.map(np.testing.assert_array_equal, first_state.opt_state, initial.opt_state)


def test_rerun_loses_no_copy_and_equals_the_dense_dispatcher(rerun, batch):
    (_, _, state, metrics), run, initial, again = rerun
    assert (metrics["overflowed"], metrics["overflowed_steps"], metrics["reruns"]) == (0, 1, 2)
    assert metrics["drop_fraction"].max() == 0 and metrics["capacity_factor"] == 4.0
    assert state.step == 1
    assert sorted(run.by_factor) == [1.25, 2.5, 4.0]  # each rung compiled once, when needed
    # the next step starts where this one ended: no rerun
    assert (again["overflowed_steps"], again["reruns"], again["capacity_factor"]) == (1, 2, 4.0)
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b),
                                           state.params, initial.params))
    assert all(changed)  # the update was applied, to every tensor

    # every expert on every token, one device: the same loss and gradient
    dense_cfg = dataclasses.replace(_cfg(), mesh=dataclasses.replace(_cfg().mesh, data=1, expert=1))
    dense_cfg = dataclasses.replace(dense_cfg, moe=dataclasses.replace(
        dense_cfg.moe, dispatcher="dense", on_overflow="drop"))
    dense = build_steps(dense_cfg, make_mesh(dense_cfg.mesh, jax.devices()[:1]))
    _, reference = dense.train_step(*_skewed(dense, batch))
    for key in ("loss", "ce", "grad_norm"):
        np.testing.assert_allclose(metrics[key], reference[key], rtol=RTOL)

    # `drop` on the same input drops most copies, counts them, and its loss differs
    drop = build_steps(_cfg(on_overflow="drop"), make_mesh(_cfg().mesh))
    dropped_state, dropped = OverflowSteps(drop)(*_skewed(drop, batch))
    assert dropped["overflowed"] == 0 and dropped["drop_fraction"].max() > 0.5
    assert int(dropped_state.step) == 1 and "reruns" not in dropped
    assert abs(float(dropped["ce"]) / float(reference["ce"]) - 1) > 10 * RTOL


def test_raise_stops_with_the_demand(batch):
    steps = build_steps(_cfg(on_overflow="raise"), make_mesh(_cfg().mesh))
    with pytest.raises(Overflow, match=r"step 1: up to \d+\.\d% of a layer's routed copies .*"
                                       r"capacity_factor=1\.25 .* busiest expert got 4\.00x"):
        OverflowSteps(steps)(*_skewed(steps, batch))


def test_the_ladder_steps_back_down_after_clean_steps(monkeypatch):
    """Steps start at the rung that last held one, one lower after PATIENCE clean steps;
    steps stand in for the compiled ones (a skewed batch overflows below E / K)."""
    import jaxmoe.step.overflow as overflow

    def steps_at(factor):
        def train_step(state, skewed):
            return state + 1, {"overflowed": int(skewed and factor < 4.0)}
        return types.SimpleNamespace(cfg=_cfg(), train_step=train_step)

    monkeypatch.setattr(overflow, "PATIENCE", 3)
    run = OverflowSteps(steps_at(1.25))
    monkeypatch.setattr(run, "_steps", steps_at)
    run(0, True)
    assert (run.rung, run.reruns) == (2, 2)
    for _ in range(3):
        run(0, False)
    assert run.rung == 1
    run(0, True)
    assert (run.rung, run.reruns, run.overflows) == (2, 3, 2)
