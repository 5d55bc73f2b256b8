"""Context parallelism on 8 fake CPU devices: sequences split over `context` (alone,
and with `data`, `expert`, every expert-parallel dispatcher and pipeline stages) train
as one device does; each check has a companion that breaks the split and is caught."""

import chex
import jax
import numpy as np
import pytest

from jaxmoe import checkpoint
from jaxmoe.config import ConfigError, config_from_dict
from jaxmoe.parallel import context
from jaxmoe.parallel.layout import DeviceLayout
from jaxmoe.parallel.sharding import make_mesh
from jaxmoe.step import build_steps

from one_device import batch, first_step, matches

BASE = {
    # 8 query heads over 2 K/V heads: context 2 splits both, 4 and 8 repeat K/V heads
    "model": {"d_model": 32, "num_layers": 3, "num_heads": 8, "num_kv_heads": 2,
              "head_dim": 4, "num_dense_layers": 1, "mlp_hidden": 64, "qk_norm": "head"},
    # capacity for every copy: the one-device reference drops nothing either
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "capacity_factor": 8.0,
            "shared_expert_hidden": 16, "balance_scope": "sequence", "expert_bias": True},
    "train": {"steps": 10, "batch_size": 8, "seq_len": 32, "accumulation_steps": 1},
    # no clip: the first step's first moment is exactly (1 - b1) x the gradient
    "optimizer": {"warmup_steps": 0, "learning_rate": 1e-2, "grad_clip": 0.0},
}


def _cfg(mesh, dispatcher="dense", **sections):
    raw = {k: {**BASE.get(k, {}), **sections.get(k, {})} for k in BASE.keys() | sections.keys()}
    return config_from_dict({**raw, "mesh": mesh, "moe": {**raw["moe"], "dispatcher": dispatcher}})


@pytest.fixture(scope="module")
def one_device():
    return first_step(_cfg({"data": 1}))


@pytest.mark.parametrize("mesh, dispatcher", [
    ({"data": 1, "context": 2}, "dense"),
    ({"data": 1, "context": 4}, "grouped"),
    ({"data": 1, "context": 8}, "dense"),
    ({"data": 2, "context": 2, "expert": 2}, "alltoall"),
    ({"data": 1, "context": 2, "expert": 4}, "allgather"),
    ({"data": 1, "context": 4, "expert": 2}, "ragged"),
    ({"data": 2, "context": 4}, "grouped"),
])
def test_split_sequences_train_as_one_device(one_device, mesh, dispatcher):
    matches(first_step(_cfg(mesh, dispatcher)), one_device)


def test_split_sequences_through_pipeline_stages():
    # 4 MoE layers on 2 stages, 2 micro-batches; the reference is the same model
    pipeline = {"stage_microbatches": 2}
    model = {"num_layers": 5}
    want = first_step(_cfg({"data": 1}, model=model, pipeline=pipeline))
    matches(first_step(_cfg({"data": 1, "stage": 2, "context": 2, "expert": 2}, "alltoall",
                        model=model, pipeline=pipeline)), want)


def test_split_sequences_with_blockwise_attention_chunked_loss_and_slices():
    """Blockwise attention runs over whole sequences after the exchange; the loss's
    chunks cut each device's 8 positions; two accumulation slices."""
    sections = {"model": {"attention_block": 8},
                "train": {"loss_chunk": 4, "accumulation_steps": 2}}
    matches(first_step(_cfg({"data": 1, "context": 4}, "grouped", **sections)),
             first_step(_cfg({"data": 1}, **sections)))


def test_a_chunk_off_by_one_position_is_caught(one_device, monkeypatch):
    # the second chunk's positions one too far (a shift of every chunk alike would
    # change nothing: RoPE sees differences of positions)
    shifted = DeviceLayout.positions
    monkeypatch.setattr(DeviceLayout, "positions", lambda self, b, n: shifted(self, b, n) + (
        jax.lax.axis_index("context") == 1))
    with pytest.raises(AssertionError):
        matches(first_step(_cfg({"data": 1, "context": 2})), one_device)


def test_skipping_the_other_chunks_keys_is_caught(one_device, monkeypatch):
    # each chunk attends to its own keys only: the K/V blocks of the others skipped
    monkeypatch.setattr(context, "attend_across", lambda attend, q, k, v, c: attend(q, k, v))
    with pytest.raises(AssertionError):
        matches(first_step(_cfg({"data": 1, "context": 2})), one_device)


def test_balance_scopes_count_a_split_sequence_once(one_device):
    """Sequence scope is checked above; the device micro-batch and global scopes too,
    where the split's rows are one device's: the companion is the sequence scope of
    the same split, which differs (4 sequences per group, not 8)."""
    for scope in ("microbatch", "global"):
        want = first_step(_cfg({"data": 1}, moe={"balance_scope": scope}))
        got = first_step(_cfg({"data": 1, "context": 4}, moe={"balance_scope": scope}))
        matches(got, want)
    assert not np.allclose(one_device[0]["balance_loss"], want[0]["balance_loss"], rtol=1e-5)


def test_a_split_the_config_cannot_take_names_its_key():
    with pytest.raises(ConfigError, match=r"mesh.context: train.seq_len=30 cannot be split"):
        _cfg({"data": 1, "context": 4}, train={"seq_len": 30})
    with pytest.raises(ConfigError, match=r"mesh.context: .*num_heads=8 over 16"):
        _cfg({"data": 1, "context": 16})
    with pytest.raises(ConfigError, match=r"mesh.context: .*needs mesh.parallelism: ddp"):
        _cfg({"data": 1, "context": 2, "parallelism": "fsdp"})
    with pytest.raises(ConfigError, match=r"train.loss_chunk: 16 does not divide the 24"):
        _cfg({"data": 1, "context": 4}, train={"loss_chunk": 16, "seq_len": 96})
    with pytest.raises(ConfigError, match=r"mesh: data=1 x stage=1 x context=16 x expert=1 "
                                          r"= 16 devices, but 8"):
        make_mesh(_cfg({"data": 1, "context": 16}, model={"num_heads": 16}).mesh)
    # fewer sequences than devices: the batch cannot be placed without a split
    cfg = _cfg({"data": 8}, train={"batch_size": 4})
    with pytest.raises(ConfigError, match=r"cannot be split over data x expert = 8 devices "
                                          r"\(mesh.context splits each sequence"):
        build_steps(cfg, make_mesh(cfg.mesh))


def test_a_context_checkpoint_resumes_under_other_splits(tmp_path):
    cfg4 = _cfg({"data": 2, "context": 4}, "grouped")
    steps4 = build_steps(cfg4, make_mesh(cfg4.mesh))
    state = steps4.init(jax.random.PRNGKey(0))
    rows = batch(cfg4)
    state, _ = steps4.train_step(state, jax.device_put(rows, steps4.batch_sharding))
    manager = checkpoint.checkpoint_manager(tmp_path, cfg4)
    checkpoint.save(manager, state, {"step": 1}, steps4)
    manager.wait_until_finished()
    saved = jax.device_get((state.params, state.opt_state, state.buffers))
    _, want = steps4.train_step(state, jax.device_put(rows, steps4.batch_sharding))
    for mesh, dispatcher in [({"data": 8}, "grouped"), ({"data": 2, "context": 2, "expert": 2},
                                                        "alltoall")]:
        cfg = _cfg(mesh, dispatcher)
        steps = build_steps(cfg, make_mesh(cfg.mesh))
        restored, _ = checkpoint.restore(checkpoint.checkpoint_dir(tmp_path), steps)
        chex.assert_trees_all_equal(
            jax.device_get((restored.params, restored.opt_state, restored.buffers)), saved)
        _, got = steps.train_step(restored, jax.device_put(rows, steps.batch_sharding))
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
