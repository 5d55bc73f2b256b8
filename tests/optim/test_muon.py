"""Muon (`optimizer.name: muon`): optax.contrib.muon's numbers on one device, each
expert's matrices orthogonalized on their own, and under ddp + EP + ZeRO-1 (and a
pipeline) the numbers of one device, each matrix made whole before it is
orthogonalized; each with a companion that breaks it."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax.contrib import MuonDimensionNumbers, muon as optax_muon

import jaxmoe
from jaxmoe.config import ConfigError, config_from_dict
from jaxmoe.optim import make_optimizer
from jaxmoe.optim.muon import MATRICES, assignment, orthogonalized, view_of
from jaxmoe.optim.params import param_name
from jaxmoe.parallel.sharding import AXES, make_mesh
from jaxmoe.step import build_steps
from jaxmoe.step.program import DeviceProgram

from model_order import in_model_order
from one_device import batch

LR, WD = 0.02, 0.1
BASE = {
    "model": {"d_model": 32, "num_layers": 3, "num_dense_layers": 1, "mlp_hidden": 64,
              "num_heads": 4, "num_kv_heads": 2},
    # capacity for every copy, per-sequence balance statistics: any split computes the
    # same losses as one device
    "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "capacity_factor": 8.0,
            "balance_scope": "sequence"},
    "train": {"steps": 10, "batch_size": 8, "seq_len": 16},
    "optimizer": {"name": "muon", "warmup_steps": 0, "schedule": "constant",
                  "learning_rate": LR, "weight_decay": WD, "grad_clip": 0.0},
}


def _cfg(mesh=None, dispatcher="dense", **sections):
    return config_from_dict({**BASE, "mesh": mesh or {"data": 1},
                             "moe": {**BASE["moe"], "dispatcher": dispatcher}, **sections})


def _dimension_numbers(params):
    """optax's description of jaxmoe's matrices; gate-and-up stacks left out (optax
    would take them as one matrix)."""
    def dims(path, p):
        view = view_of(param_name(path), p)
        if view is None or view.halves:
            return None
        b = view.batch_axes(p.ndim)
        return MuonDimensionNumbers(tuple(range(b, b + view.fan_in_axes)),
                                    tuple(range(b + view.fan_in_axes, p.ndim)))
    return jax.tree_util.tree_map_with_path(dims, params)


def test_numbers_are_optax_muons_with_moonlights_scale():
    cfg = _cfg()
    params = jaxmoe.init(jaxmoe.api.local_config(cfg), jax.random.PRNGKey(0))
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 3 * len(jax.tree.leaves(params))))
    grads = [jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)
             for _ in range(3)]
    ours, theirs = make_optimizer(cfg.optimizer, 10), optax_muon(
        LR, consistent_rms=0.2, weight_decay=WD, nesterov=True,
        muon_weight_dimension_numbers=_dimension_numbers(params))
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    for g in grads:  # three steps: momentum and its bias correction at work
        u_ours, s_ours = ours.update(g, s_ours, params)
        u_theirs, s_theirs = theirs.update(g, s_theirs, params)
    dims = jax.tree.leaves(_dimension_numbers(params),
                           is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    compared = 0
    for (path, a), b, d in zip(jax.tree_util.tree_leaves_with_path(u_ours),
                               jax.tree.leaves(u_theirs), dims):
        if d is None:
            continue
        # five fp32 Newton-Schulz steps in another association: ~1e-6 of the update
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(b).max()),
                                   err_msg=param_name(path))
        compared += 1
    assert compared == 10  # attention's 4 and w_down, in the dense and the MoE stack
    # companion: Keller Jordan's width scaling (optax's default) is another update
    plain = optax_muon(LR, weight_decay=WD, muon_weight_dimension_numbers=_dimension_numbers(
        params))
    u_plain, _ = plain.update(grads[0], plain.init(params), params)
    u_first, _ = ours.update(grads[0], ours.init(params), params)
    w = ("moe_layers", "attn", "w_q")
    a, b = u_first[w[0]][w[1]][w[2]], u_plain[w[0]][w[1]][w[2]]
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 0.1 * np.abs(np.asarray(a)).max()


def test_which_tensors_take_which():
    params = jaxmoe.init(jaxmoe.api.local_config(_cfg()), jax.random.PRNGKey(0))
    got = assignment(params)
    assert {n for n, o in got.items() if o == "muon"} == {
        f"{stack}/{name}" for stack in ("dense_layers", "moe_layers")
        for name in ("attn/w_q", "attn/w_k", "attn/w_v", "attn/w_o")} | {
        "dense_layers/mlp/w_gate_up", "dense_layers/mlp/w_down",
        "moe_layers/moe/experts/w_gate_up", "moe_layers/moe/experts/w_down"}
    # the embedding, head, router and norms stay AdamW's; adamw_params moves more there
    assert got["embed"] == got["head"] == got["moe_layers/moe/router/w"] == "adamw"
    moved = assignment(params, ("dense_layers/*",))
    assert all(o == "adamw" for n, o in moved.items() if n.startswith("dense_layers"))


def test_each_expert_is_orthogonalized_on_its_own():
    """A stack of two experts' w_down, [2, F, D], gets each expert's own update;
    orthogonalizing the stack as one [2 F, D] matrix (what a tensor-wide Muon does)
    does not."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    a, b = jax.random.normal(k1, (16, 8)), jax.random.normal(k2, (16, 8))
    view = MATRICES["w_down"]
    both = orthogonalized(jnp.stack([a, b]), view, 5)
    np.testing.assert_allclose(both[0], orthogonalized(a[None], view, 5)[0], atol=1e-6)
    np.testing.assert_allclose(both[1], orthogonalized(b[None], view, 5)[0], atol=1e-6)
    # in bfloat16 the quintic (which pushes singular values into about [0.5, 1.5], not
    # onto 1) lands elsewhere in that band: the same directions, singular values in it
    low = np.asarray(orthogonalized(jnp.stack([a, b]), view, 5, jnp.bfloat16))
    for got, want in zip(low, np.asarray(both)):
        assert np.all((np.linalg.svd(got, compute_uv=False) > 0.3)
                      & (np.linalg.svd(got, compute_uv=False) < 1.6))
        assert np.sum(got * want) / np.linalg.norm(got) / np.linalg.norm(want) > 0.95
    assert np.abs(low - np.asarray(both)).max() > 1e-3  # not float32's numbers
    as_one = orthogonalized(jnp.concatenate([a, b]), view, 5)
    assert np.abs(np.asarray(as_one[:16]) - np.asarray(both[0])).max() > 0.05
    # gate and up: two matrices side by side, each its own
    gate_up = orthogonalized(jnp.concatenate([a, b], axis=1)[None], MATRICES["w_gate_up"], 5)[0]
    np.testing.assert_allclose(gate_up[:, :8], orthogonalized(a[None], view, 5)[0], atol=1e-6)


def _two_steps(cfg):
    """Parameters after two steps from the seed's, in model order, and the updates'
    largest magnitude per tensor."""
    devices = jax.devices()[:math.prod(getattr(cfg.mesh, a) for a in AXES)]
    steps = build_steps(cfg, make_mesh(cfg.mesh, devices))
    state = steps.init(jax.random.PRNGKey(0))
    start = in_model_order(jax.device_get(state.params), cfg)
    rows = jax.device_put(batch(cfg), steps.batch_sharding)
    for _ in range(2):
        state, _ = steps.train_step(state, rows)
    end = in_model_order(jax.device_get(state.params), cfg)
    return end, jax.tree.map(lambda e, s: float(np.abs(np.asarray(e) - np.asarray(s)).max()),
                             end, start)


def _close(got, want, sizes):
    """Reduced gradients in another fp32 order (~1e-5 relative), through momentum and
    five Newton-Schulz steps: within 1e-3 of each tensor's largest update. A matrix
    orthogonalized in parts is off by the update's own size."""
    jax.tree.map(lambda g, w, s: np.testing.assert_allclose(g, w, rtol=0, atol=1e-3 * s),
                 got, want, sizes)


@pytest.fixture(scope="module")
def one_device():
    return _two_steps(_cfg())


MESHES = [({"data": 2, "expert": 4}, "alltoall", {}),
          ({"data": 4, "expert": 2}, "alltoall", {}),
          ({"data": 2, "stage": 2, "expert": 2}, "alltoall",
           {"pipeline": {"stage_microbatches": 2}}),
          # ZeRO-1 over the context replicas too; and the auto-sharded program, whose
          # global arrays hold every matrix whole
          ({"data": 2, "context": 2, "expert": 2}, "alltoall", {}),
          ({"data": 8, "parallelism": "fsdp"}, "dense", {})]


@pytest.mark.parametrize("mesh, dispatcher, sections", MESHES)
def test_ddp_equals_one_device(one_device, mesh, dispatcher, sections):
    got, _ = _two_steps(_cfg(mesh, dispatcher, **sections))
    want, sizes = one_device
    _close(got, want, sizes)


def test_every_way_to_a_whole_matrix_is_taken(monkeypatch):
    """The meshes above take all three ways to whole matrices: ZeRO-1 splits a batch
    of them (data 2 x expert 4: each device's one expert of both MoE layers split
    by layer; nothing moves), splits the matrices themselves where no batch axis
    divides but their count does (data 4 x expert 2: 2 layers x 2 local experts over
    4 devices, dealt out by an all-to-all), or splits fewer matrices than devices
    (the dense layer's, dealt out padded with zero matrices)."""
    taken = []
    real = DeviceProgram.whole_matrices

    def spy(self, name, x, view, fn):
        r = self.plan_of[name]
        batch = view.batch_axes(x.ndim)
        n = math.prod(self.mesh.shape[a] for a in r.scatter_axes)
        taken.append("local" if not r.scatter_axes or r.dim < batch else
                     "deal" if math.prod(x.shape[:batch]) % n == 0 else "padded")
        return real(self, name, x, view, fn)

    monkeypatch.setattr(DeviceProgram, "whole_matrices", spy)
    for mesh in ({"data": 2, "expert": 4}, {"data": 4, "expert": 2}):
        _two_steps(_cfg(mesh, "alltoall"))
    assert {"local", "deal", "padded"} <= set(taken), taken


def test_orthogonalizing_a_shard_is_caught(one_device, monkeypatch):
    """Companion: each device orthogonalizing its own part of a split matrix misses
    the one-device numbers."""
    monkeypatch.setattr(DeviceProgram, "whole_matrices", lambda self, name, x, view, fn: fn(x))
    got, _ = _two_steps(_cfg({"data": 4, "expert": 2}, "alltoall"))
    want, sizes = one_device
    with pytest.raises(AssertionError):
        _close(got, want, sizes)


def test_settings_are_checked():
    for key, value in (("muon_momentum", 1.0), ("muon_ns_steps", 0), ("muon_rms", 0.0)):
        with pytest.raises(ConfigError, match=f"optimizer.{key}"):
            config_from_dict({**BASE, "optimizer": {**BASE["optimizer"], key: value}})
    with pytest.raises(ConfigError, match="optimizer.muon_rms: used by muon only"):
        config_from_dict({"optimizer": {"muon_rms": 0.3}})


def _run(tmp_path, name, steps=4, stop_after=None, optimizer="muon"):
    from jaxmoe.data.corpus import load_corpus
    from jaxmoe.train import train
    cfg = _cfg({"data": 2, "expert": 4}, "alltoall",  # every device of the process
               train={**BASE["train"], "steps": steps, "eval_every": 0, "eval_batches": 1,
                      "run_dir": str(tmp_path / name), "evals": {"tasks": []}},
               optimizer={**BASE["optimizer"], "name": optimizer},
               checkpoint={"every": 2, "keep": 3}, logging={"progress": False})
    train(cfg, load_corpus("stdlib", None, 256, cfg.train.seq_len), stop_after=stop_after)
    return cfg


def test_checkpoints_resume_bit_exact_and_refuse_adamws_state(tmp_path):
    """Muon's state (its momentum beside AdamW's moments, in ZeRO-1 shards over data 2 x
    expert 4) saved at step 2 and resumed gives step 4's state bit for bit; an AdamW run's checkpoint resumed with muon is
    refused, saying what the state is and how to go on from the weights."""
    from jaxmoe import checkpoint

    cfg = _run(tmp_path, "straight")
    _run(tmp_path, "resumed", stop_after=2)
    _run(tmp_path, "resumed")

    def state(name):
        steps = build_steps(cfg, make_mesh(cfg.mesh))
        restored, _ = checkpoint.restore(checkpoint.checkpoint_dir(tmp_path / name), steps, 4)
        return jax.device_get((restored.params, restored.opt_state))

    jax.tree.map(np.testing.assert_array_equal, state("resumed"), state("straight"))
    _run(tmp_path, "adamw", steps=2, optimizer="adamw")
    with pytest.raises(checkpoint.CheckpointError,
                       match="optimizer.name: checkpoint 'adamw', config 'muon' .the saved "
                             "optimizer state is adamw's; to go on from the weights"):
        _run(tmp_path, "adamw", steps=4)
