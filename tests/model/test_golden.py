"""Golden numbers: the first three steps of a fixed tiny config, seed and batch, pinned
to recorded values, on one device and on 8 fake devices under ddp + EP.

Every other test compares two computations; a change of numerics that moves both
sides passes them. This one pins the values themselves.

Tolerance, from fp32 arithmetic (u = 2^-24). The first step's loss and gradient
norm depend only on the init and the batch: each is a chain of at most m = 16
roundings of sums of at most n = 512 terms (attention over 64 positions, MLPs
and experts of D = 64 and F = 128, the LM head, the mean over 512 tokens). A sum
of n terms rounded in some order is off by about sqrt(n) u of its terms'
magnitude (independent rounding errors: the typical size, not the worst case of
n u, which no real summation order reaches), so 16 x sqrt(512) x u = 2.2e-5
relative. The squared norm is a sum of ~4e5 positive squares, which no
cancellation makes ill-conditioned. One device and eight sum in different
orders (measured apart by ~3.5e-7 relative, 60x inside the bound), and other
CPUs vectorise differently. Later steps see the earlier updates: Adam's step
moves a weight by lr g / (|g| + eps) (bias-corrected), whose sensitivity to g is
at most lr / eps, so with eps = lr (set here) a weight carries at most its
gradient's own relative rounding into the next step, and step k's figures get k
times the bound. The companions show that real changes of numerics move the
figures by far more: an init scale off by 1%, and the router's z-loss term left
out.
"""

import jax
import numpy as np
import pytest

from jaxmoe.config import config_from_dict
from jaxmoe.parallel.sharding import make_mesh
from jaxmoe.step import build_steps

CONFIG = {
    "model": {"d_model": 64, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
              "num_dense_layers": 1, "mlp_hidden": 128},
    # room for every token and a global balance loss: the figures do not depend on
    # how the batch is split over devices
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 128, "capacity_factor": 4.0,
            "balance_scope": "global"},
    "train": {"steps": 3, "batch_size": 8, "seq_len": 64},
    "optimizer": {"learning_rate": 1e-3, "eps": 1e-3, "warmup_steps": 0,
                  "schedule": "constant"},
}
MESHES = {"1 device": ({"data": 1}, "grouped"), "ddp + EP 8": ({"data": 2, "expert": 4},
                                                                 "alltoall")}
# recorded 2026-12-01 on one device, AMD EPYC (`pytest -n 0 -s tests/model/test_golden.py`
# prints them)
LOSS = [5.57569694519043, 5.493044853210449, 5.415976524353027]
GRAD_NORM = [0.6231347322463989, 0.6040768027305603, 0.577119767665863]
TOLERANCE = 16 * 512 ** 0.5 * 2.0 ** -24


def _run(mesh: dict, dispatcher: str, **model) -> tuple[list, list]:
    moe = {**CONFIG["moe"], "dispatcher": dispatcher, **model.pop("moe", {})}
    cfg = config_from_dict({**CONFIG, "mesh": mesh, "moe": moe,
                            "model": {**CONFIG["model"], **model}})
    steps = build_steps(cfg, make_mesh(cfg.mesh, jax.devices()[:8 if len(mesh) > 1 else 1]))
    state = steps.init(jax.random.PRNGKey(0))
    batch = np.random.default_rng(0).integers(0, 256, (8, 65), dtype=np.int32)
    losses, norms = [], []
    for _ in range(3):
        state, metrics = steps.train_step(state, jax.device_put(batch, steps.batch_sharding))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    print(f"loss {losses!r}\ngrad_norm {norms!r}")
    return losses, norms


def _off(got, want) -> float:
    """The largest relative difference, in units of the first step's tolerance."""
    return max(abs(a - b) / abs(b) for a, b in zip(got, want)) / TOLERANCE


@pytest.mark.parametrize("mesh", MESHES)
def test_first_three_steps_are_pinned(mesh):
    losses, norms = _run(*MESHES[mesh])
    for k in range(3):
        assert losses[k] == pytest.approx(LOSS[k], rel=(k + 1) * TOLERANCE)
        assert norms[k] == pytest.approx(GRAD_NORM[k], rel=(k + 1) * TOLERANCE)


def test_changes_of_numerics_are_caught():
    """Each moves a pinned figure by over ten times the third step's tolerance."""
    _, norms = _run({"data": 1}, "grouped", init_std=0.0202)
    assert _off(norms, GRAD_NORM) > 10 * 3
    losses, _ = _run({"data": 1}, "grouped", moe={"z_loss_weight": 0.0})
    assert _off(losses, LOSS) > 10 * 3
