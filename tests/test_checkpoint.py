"""Checkpoints: exact resume, surviving SIGKILL mid-save, another mesh, NaN policy."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxmoe import checkpoint
from jaxmoe.config import config_from_dict
from jaxmoe.data.corpus import load_corpus
from jaxmoe.model.transformer import map_moe_stack
from jaxmoe.optim.schedules import learning_rate_schedule
from jaxmoe.parallel.pipeline import StageStack
from jaxmoe.parallel.sharding import make_mesh
from jaxmoe.step import build_steps
from jaxmoe.train import TooManyBadSteps, train

from model_order import in_model_order
from poison import poison_steps

SMALL = {
    "model": {"d_model": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "num_dense_layers": 1, "mlp_hidden": 64},
    "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "expert_bias": True},
    "train": {"steps": 8, "batch_size": 16, "seq_len": 32, "eval_every": 0, "eval_batches": 1,
              "evals": {"tasks": []}},
    "optimizer": {"warmup_steps": 2},
    "checkpoint": {"every": 2, "keep": 3},
    "logging": {"log_every": 1, "progress": False},
}
OVERRIDES = [f"{sec}.{k}={json.dumps(v)}" for sec, d in SMALL.items() for k, v in d.items()]


def _cmd(run_dir, overrides):
    cmd = [sys.executable, "-m", "jaxmoe.train", "--config",
           str(Path(__file__).parent.parent / "configs" / "tiny.yaml")]
    for o in overrides + [f"train.run_dir={run_dir}"]:
        cmd += ["--set", o]
    return cmd


def _cli(run_dir, *args, config=None):
    return subprocess.run(_cmd(run_dir, config or OVERRIDES) + list(args), capture_output=True,
                          text=True, timeout=300)


def _losses(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _params(run_dir, step):
    cfg = config_from_dict(SMALL)
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    state, _ = checkpoint.restore(checkpoint.checkpoint_dir(run_dir), steps, step)
    return jax.device_get((state.params, state.opt_state, state.buffers))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight")
    result = _cli(run)
    assert result.returncode == 0, result.stderr
    return run


@pytest.mark.slow
def test_resume_is_bit_exact(straight, tmp_path):
    first = _cli(tmp_path, "--stop-after", "4")
    assert first.returncode == 0 and "stopped after 4 steps" in first.stdout, first.stderr
    assert checkpoint.complete_steps(checkpoint.checkpoint_dir(tmp_path)) == [2, 4]
    second = _cli(tmp_path, "--resume")
    assert second.returncode == 0, second.stderr
    assert _losses(tmp_path) == _losses(straight)  # every step, exactly
    a, b = _params(tmp_path, 8), _params(straight, 8)
    chex.assert_trees_all_equal(a, b)
    # the comparison has teeth: step 8 differs from step 6
    assert any(not np.array_equal(x, y) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(_params(straight, 6))))


@pytest.mark.slow
def test_sigkill_mid_save_resumes_from_last_complete(straight, tmp_path):
    big = OVERRIDES + ["model.d_model=256", "moe.expert_hidden=512", "train.steps=12",
                       "checkpoint.every=1"]
    cmd = _cmd(tmp_path, big)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = checkpoint.checkpoint_dir(tmp_path)
    deadline, killed_during_save = time.time() + 240, False
    while time.time() < deadline and proc.poll() is None:
        done = checkpoint.complete_steps(ckpts)
        partial = [p for p in ckpts.iterdir() if "tmp" in p.name] if ckpts.is_dir() else []
        if len(done) >= 3 and partial:
            os.kill(proc.pid, signal.SIGKILL)
            killed_during_save = True
            break
        time.sleep(0.002)
    proc.wait()
    assert killed_during_save, "never caught a save in progress"
    done = checkpoint.complete_steps(ckpts)
    last = done[-1]
    # resume with the uninterrupted run's settings (as the big run, 12 steps); the
    # two runs are independent, so they run side by side; the reference saves only at
    # its end (saving changes no step)
    reference = tmp_path.parent / (tmp_path.name + "_ref")
    runs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for c in (_cmd(reference, big + ["checkpoint.every=0"]), cmd)]
    (_, ref_err), (resumed_out, resumed_err) = [p.communicate(timeout=600) for p in runs]
    assert runs[0].returncode == 0, ref_err
    assert runs[1].returncode == 0, resumed_err
    assert f"resumed from step {last}" in resumed_out
    got, want = _losses(tmp_path), _losses(reference)
    assert [got[s] for s in range(last + 1, 13)] == [want[s] for s in range(last + 1, 13)]


def _state_values(state):
    return jax.device_get((state.params, state.opt_state, state.buffers, state.step))


def test_restore_into_another_mesh(tmp_path):
    cfg8 = config_from_dict({**SMALL, "mesh": {"data": 8},
                             "moe": {**SMALL["moe"], "dispatcher": "grouped"}})
    steps8 = build_steps(cfg8, make_mesh(cfg8.mesh))
    state = steps8.init(jax.random.PRNGKey(0))
    batch = np.random.default_rng(0).integers(0, 256, (16, 33)).astype(np.int32)
    state, _ = steps8.train_step(state, jax.device_put(batch, steps8.batch_sharding))
    manager = checkpoint.checkpoint_manager(tmp_path, cfg8)
    checkpoint.save(manager, state, {"step": 1}, steps8)
    manager.wait_until_finished()
    saved = _state_values(state)
    for data, expert in [(2, 4), (4, 2)]:
        cfg = config_from_dict({**SMALL, "mesh": {"data": data, "expert": expert},
                                "moe": {**SMALL["moe"], "dispatcher": "alltoall"}})
        steps = build_steps(cfg, make_mesh(cfg.mesh))
        restored, data_state = checkpoint.restore(checkpoint.checkpoint_dir(tmp_path), steps)
        chex.assert_trees_all_equal(_state_values(restored), saved)
        w = restored.params["moe_layers"]["moe"]["experts"]["w_gate_up"][...]
        assert w.sharding.spec[1] == "expert"  # laid out for the new mesh
        restored, metrics = steps.train_step(restored, jax.device_put(batch, steps.batch_sharding))
        assert np.isfinite(float(metrics["loss"])) and int(restored.step) == 2


# 6 MoE layers on 2 stages x 2 virtual stages: held as [2, 2, 2], 2 slots of padding
CIRCULAR = {**SMALL, "model": {**SMALL["model"], "num_layers": 7},
            "moe": {**SMALL["moe"], "dispatcher": "alltoall"},
            "mesh": {"data": 2, "stage": 2, "expert": 2},
            "pipeline": {"virtual_stages": 2, "stage_microbatches": 2}}


def _write(run, cfg, state, version, meta=None):
    """A checkpoint of `state` as format `version` wrote it (state laid out already)."""
    manager = checkpoint.checkpoint_manager(run, cfg)
    manager.save(1, args=checkpoint.ocp.args.Composite(
        state=checkpoint.ocp.args.StandardSave(state),
        meta=checkpoint.ocp.args.JsonSave({"format_version": version, "data": {"step": 1},
                                           **(meta or {})})))
    manager.wait_until_finished()


def test_a_circular_pipeline_checkpoint_resumes_under_other_layouts(tmp_path):
    cfg = config_from_dict(CIRCULAR)
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    assert steps.program.stack == StageStack(2, 2, 2)  # teeth: neither [Lm] nor unpadded
    state = steps.init(jax.random.PRNGKey(0))
    batch = np.random.default_rng(0).integers(0, 256, (16, 33)).astype(np.int32)
    state, _ = steps.train_step(state, jax.device_put(batch, steps.batch_sharding))
    model = in_model_order(_state_values(state), cfg)  # what every layout must restore
    # format 3 held model order; formats 2 and 1 the pipeline's stage-major slots, padded
    slots = np.array([0, 1, 4, 5, 2, 3, 6, 7])
    stage_major = map_moe_stack(lambda a: np.asarray(a).reshape((8,) + a.shape[3:])[slots],
                                jax.device_get(state))
    as_format = {checkpoint.FORMAT_VERSION: None,
                 3: jax.device_get(steps.program.in_model_order(state)), 2: stage_major,
                 1: stage_major}
    # other meshes, one a pipeline of another stack ([1, 2, 3]: no virtual stages)
    others = [config_from_dict({**CIRCULAR, "mesh": mesh, "pipeline": pipeline,
                                "moe": {**CIRCULAR["moe"], "dispatcher": dispatcher}})
              for mesh, dispatcher, pipeline in [
                  ({"data": 8}, "grouped", {}), ({"data": 4, "expert": 2}, "alltoall", {}),
                  ({"data": 4, "stage": 2}, "grouped", {"stage_microbatches": 2})]]
    others = [(other, build_steps(other, make_mesh(other.mesh))) for other in others]
    assert others[-1][1].program.stack == StageStack(1, 2, 3)
    for version, laid_out in as_format.items():
        run = tmp_path / f"v{version}"
        if laid_out is None:
            manager = checkpoint.checkpoint_manager(run, cfg)
            checkpoint.save(manager, state, {"step": 1}, steps)
            manager.wait_until_finished()
        else:
            config = _format_2_config(cfg) if version <= 2 else cfg.to_dict()
            _write(run, cfg, laid_out, version, {"config": config})
        weights, _ = checkpoint.restore_weights(checkpoint.checkpoint_dir(run))
        chex.assert_trees_all_equal(jax.device_get(weights), nnx.merge_state(model[0], model[2]))
        if version < checkpoint.RESUMES_SINCE:
            continue  # only its weights load
        for other, other_steps in others:
            restored, _ = checkpoint.restore(checkpoint.checkpoint_dir(run), other_steps)
            chex.assert_trees_all_equal(in_model_order(_state_values(restored), other), model)
        # and back into the circular layout: the same state, padding zeroed
        restored, _ = checkpoint.restore(checkpoint.checkpoint_dir(run), steps)
        chex.assert_trees_all_equal(in_model_order(_state_values(restored), cfg), model)
        pads = ~np.asarray(steps.program.stack.real(cfg.num_moe_layers))
        moe = jax.tree.leaves(_state_values(restored)[0]["moe_layers"])
        assert all(not np.any(np.asarray(a)[pads]) for a in moe)
    # and trains on in another layout
    current = checkpoint.checkpoint_dir(tmp_path / f"v{checkpoint.FORMAT_VERSION}")
    restored, _ = checkpoint.restore(current, other_steps)
    restored, metrics = other_steps.train_step(restored,
                                               jax.device_put(batch, other_steps.batch_sharding))
    assert np.isfinite(float(metrics["loss"])) and int(restored.step) == 2


def _format_2_config(cfg):
    """The config as format 2 wrote it: one `microbatches` key in train and pipeline."""
    raw = cfg.to_dict()
    raw["train"]["microbatches"] = raw["train"].pop("accumulation_steps")
    raw["pipeline"]["microbatches"] = raw["pipeline"].pop("stage_microbatches")
    return raw


def test_nan_steps_are_skipped_then_stop(tmp_path, monkeypatch):
    corpus = load_corpus("stdlib", None, 256, 32)
    bad = {3}
    poison_steps(monkeypatch, bad)  # the training batch of state.step 3 has a NaN loss

    cfg = config_from_dict({**SMALL, "train": {**SMALL["train"], "run_dir": str(tmp_path / "a")}})
    train(cfg, corpus)  # one bad step: skipped, counted, run goes on
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in lines if "loss" in r}
    assert [by_step[s]["skipped"] for s in range(1, 9)] == [0, 0, 0, 1, 0, 0, 0, 0]
    assert by_step[4]["bad_steps"] == 1 and by_step[5]["bad_steps"] == 0
    # The logged rate is the one applied: the skipped step 4 does not advance the
    # schedule, so step 5 takes the third post-warmup rate, as step 4 would have.
    lr_at = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    applied = [float(lr_at(n)) for n in (0, 1, 2, 3, 3, 4, 5, 6)]
    np.testing.assert_allclose([by_step[s]["lr"] for s in range(1, 9)], applied, rtol=1e-6)
    assert float(lr_at(3)) != float(lr_at(4))  # a rate by the step counter would differ

    # the one skipped step put its checkpoint off to the next good step
    assert checkpoint.complete_steps(checkpoint.checkpoint_dir(tmp_path / "a")) == [5, 6, 8]

    bad.update(range(3, 100))  # from state.step 3 on, every step is bad
    cfg = config_from_dict({**SMALL, "train": {**SMALL["train"], "run_dir": str(tmp_path / "b"),
                                                "max_bad_steps": 3}})
    with pytest.raises(TooManyBadSteps, match="3 consecutive steps up to 6 .* from the weights of "
                       "step 3; stopped; the newest good checkpoint, step 2, is kept"):
        train(cfg, corpus)
    # no checkpoint from inside the streak (step 4's save waited for a good step)
    assert checkpoint.complete_steps(checkpoint.checkpoint_dir(tmp_path / "b")) == [2]


def test_a_diverged_checkpoint_is_set_aside_and_the_resume_takes_the_one_before(
        tmp_path, monkeypatch, capsys):
    """Checkpoints every step; from step 3 on every step is non-finite: the weights of
    step 2 (saved: its own step was finite) are the diverged ones. The stop sets
    checkpoint 2 aside (kept, renamed), saves nothing from the streak, names the step it
    kept; a resume on healthy data starts from step 1, says so, and runs to the end.
    Companion: saving on schedule inside the streak (as before) would have kept
    checkpoints 3 and 4 of the stuck weights, the newest resumed from."""
    corpus = load_corpus("stdlib", None, 256, 32)
    run = tmp_path / "run"
    cfg = config_from_dict({**SMALL, "train": {**SMALL["train"], "run_dir": str(run),
                                                "max_bad_steps": 3},
                            "checkpoint": {"every": 1, "keep": 10}})
    ckpts = checkpoint.checkpoint_dir(run)
    poison_steps(monkeypatch, set(range(2, 100)))  # state.step 2 on: steps 3, 4, 5
    with pytest.raises(TooManyBadSteps) as stopped:
        train(cfg, corpus)
    assert str(stopped.value) == (
        f"3 consecutive steps up to 5 had a non-finite loss or gradient (train.max_bad_steps=3), "
        f"from the weights of step 2; stopped; checkpoint 2 set aside as diverged "
        f"({ckpts}/STEP.diverged); the newest good checkpoint, step 1, is kept in {ckpts}")
    assert checkpoint.complete_steps(ckpts) == [1]
    assert (ckpts / "2.diverged" / "state").is_dir()  # kept whole, not a step any more
    monkeypatch.undo()  # healthy data
    capsys.readouterr()
    summary = train(cfg, corpus)
    out = capsys.readouterr().out
    assert f"resumed from step 1 in {ckpts} (newer checkpoint 2 set aside as diverged)" in out
    assert summary["step"] == cfg.train.steps
    assert checkpoint.complete_steps(ckpts)[-1] == cfg.train.steps


def test_a_format_1_checkpoint_loads_its_weights_but_does_not_resume(tmp_path, monkeypatch):
    """Format 1 saved optax's chained (clip, AdamW) state; the weights are read
    without it, and resuming is refused by name."""
    cfg = config_from_dict(SMALL)
    steps = build_steps(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    state = steps.init(jax.random.PRNGKey(3))
    chained = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    old = state._replace(opt_state=chained.init(state.params))
    monkeypatch.setattr(checkpoint, "FORMAT_VERSION", 1)
    manager = checkpoint.checkpoint_manager(tmp_path, cfg)
    checkpoint.save(manager, old, {"step": 0}, steps)
    manager.wait_until_finished()
    monkeypatch.undo()
    weights, saved_cfg = checkpoint.restore_weights(checkpoint.checkpoint_dir(tmp_path))
    chex.assert_trees_all_equal(jax.device_get(weights),
                 jax.device_get(nnx.merge_state(state.params, state.buffers)))
    assert saved_cfg == cfg
    with pytest.raises(checkpoint.CheckpointError, match="format version 1, whose optimizer state"):
        checkpoint.restore(checkpoint.checkpoint_dir(tmp_path), steps)


def _snapshot(directory):
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in Path(directory).rglob("*"))


@pytest.mark.slow
def test_bad_resume_inputs_leave_directory_untouched(straight, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    before = _snapshot(run)
    shape = _cli(run, "--resume", config=OVERRIDES + ["model.d_model=64"])
    assert shape.returncode == 2 and "model.d_model: checkpoint 32, config 64" in shape.stderr
    missing = _cli(tmp_path / "empty", "--resume")
    assert missing.returncode == 2 and "no complete checkpoint" in missing.stderr
    assert not (tmp_path / "empty").exists()
    meta = run / "checkpoints" / "8" / "meta" / "metadata"
    original = meta.read_text()
    current, _ = checkpoint.restore_weights(run / "checkpoints")
    version = f'"format_version": {checkpoint.FORMAT_VERSION}'
    meta.write_text(original.replace(version, '"format_version": 99'))
    newer = _cli(run, "--resume")
    assert newer.returncode == 2 and "format version 99" in newer.stderr
    meta.write_text(original.replace(version, '"format_version": 1'))
    older = _cli(run, "--resume")
    assert older.returncode == 2 and "format version 1, whose optimizer state" in older.stderr
    # the weights of the older format still load, and are the same arrays
    weights, _ = checkpoint.restore_weights(run / "checkpoints")
    chex.assert_trees_all_equal(weights, current)
    assert "experts" in str(jax.tree_util.tree_structure(weights))
    # a damaged newest step is skipped by default (tests/test_faults.py); refused here
    strict = OVERRIDES + ["checkpoint.skip_damaged=false"]
    meta.write_text("{not json")
    corrupt = _cli(run, "--resume", config=strict)
    assert corrupt.returncode == 2 and "corrupt" in corrupt.stderr
    meta.write_text(original)
    for f in (run / "checkpoints" / "8" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(b"\0" * 64)
    damaged = _cli(run, "--resume", config=strict)
    assert damaged.returncode == 2 and "corrupt or unreadable" in damaged.stderr, damaged.stderr
    for errs in (shape, missing, newer, older, corrupt, damaged):
        assert len(errs.stderr.strip().splitlines()) == 1, errs.stderr
    after = _snapshot(run)
    changed = {a[0] for a in after} ^ {b[0] for b in before}
    assert not changed
    untouched = [a for a, b in zip(after, before) if "checkpoints/8" not in a[0]]
    assert untouched == [b for b in before if "checkpoints/8" not in b[0]]


def test_relative_paths_load(straight, monkeypatch):
    """orbax wants absolute paths: every user-given path is resolved first."""
    from jaxmoe.api import load_params
    want, _ = load_params(straight)
    monkeypatch.chdir(straight.parent)
    for relative in (straight.name, f"{straight.name}/checkpoints", f"{straight.name}/checkpoints/8"):
        got, _ = load_params(relative)
        chex.assert_trees_all_equal(got, want)


def test_a_bug_while_reading_is_not_reported_as_corruption(straight, monkeypatch):
    import orbax.checkpoint as ocp

    def fail_with(error):
        def restore(self, *args, **kwargs):
            raise error
        monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)

    fail_with(TypeError("a bug"))
    with pytest.raises(TypeError, match="a bug"):
        checkpoint.restore_weights(checkpoint.checkpoint_dir(straight))
    # what orbax raises for damaged array files: a bare Exception from TensorStore
    fail_with(Exception("Encountered error while reading array index"))
    with pytest.raises(checkpoint.CheckpointError, match="corrupt or unreadable"):
        checkpoint.restore_weights(checkpoint.checkpoint_dir(straight))


def test_keep_every_keeps_multiples_beside_the_latest(tmp_path):
    cfg = config_from_dict({**SMALL, "train": {**SMALL["train"], "steps": 7,
                                               "run_dir": str(tmp_path)},
                            "checkpoint": {"every": 1, "keep": 1, "keep_every": 3}})
    train(cfg, load_corpus("stdlib", None, 256, cfg.train.seq_len))
    assert checkpoint.complete_steps(checkpoint.checkpoint_dir(tmp_path)) == [3, 6, 7]


def test_export_safetensors(straight, tmp_path):
    from safetensors.numpy import load_file
    out = tmp_path / "model.safetensors"
    result = subprocess.run([sys.executable, "-m", "jaxmoe.export", "--checkpoint", str(straight),
                             "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    tensors = load_file(out)
    params, _, buffers = _params(straight, 8)
    embed = np.asarray(params["embed"][...])
    np.testing.assert_array_equal(tensors["embedding"], embed)
    w = np.asarray(params["moe_layers"]["moe"]["experts"]["w_gate_up"][...])
    np.testing.assert_array_equal(tensors["layers.1.moe.experts.w_gate_up"], w[0])
    assert tensors["layers.0.mlp.w_gate_up"].shape == (32, 128)
    bias = np.asarray(buffers["moe_layers"]["moe"]["router"]["bias"][...])
    np.testing.assert_array_equal(tensors["layers.1.moe.router.bias"], bias[0])
    from jaxmoe.plan.counts import param_counts
    n = sum(v.size for k, v in tensors.items() if not k.endswith("router.bias"))
    assert n == param_counts(config_from_dict(SMALL)).total
    missing = subprocess.run([sys.executable, "-m", "jaxmoe.export", "--checkpoint",
                              str(tmp_path / "nothing"), "--out", str(tmp_path / "x.st")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no complete checkpoint" in missing.stderr
    assert not (tmp_path / "x.st").exists()


@pytest.mark.slow
def test_sigterm_saves_and_stops(tmp_path):
    cmd = _cmd(tmp_path, OVERRIDES + ["train.steps=400", "checkpoint.every=1000"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(_losses(tmp_path)) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err  # 128 + SIGTERM: stopped short
    assert "stopped on SIGTERM" in out
    steps = checkpoint.complete_steps(checkpoint.checkpoint_dir(tmp_path))
    assert len(steps) == 1 and 3 <= steps[0] < 400


def test_a_checkpoint_saved_with_a_boolean_qk_norm_still_fits():
    cfg = config_from_dict({})
    saved = cfg.to_dict()
    saved["model"] = {**saved["model"], "qk_norm": True}  # as checkpoints before "head" said
    checkpoint.check_compatible(saved, cfg, Path("old"))
    saved["model"]["qk_norm"] = False
    with pytest.raises(checkpoint.CheckpointError,
                       match="model.qk_norm: checkpoint False, config 'head'"):
        checkpoint.check_compatible(saved, cfg, Path("old"))
