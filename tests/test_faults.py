"""Faults lose nothing and say one line: a save that fails stops the run and keeps the
last complete checkpoint, a damaged checkpoint gives way to the newest older one that
reads back (set aside, never deleted), a resume on other data says so, and a CPU-only
start with the GPU compiler installed is quiet. Each case runs the commands a user
runs, on a tiny model."""

import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import yaml

from jaxmoe import checkpoint
from jaxmoe.export import export
from jaxmoe.fake_devices import without_fake_devices
from jaxmoe.train import main as train_main

# pytest swaps sys.unraisablehook per test, past jaxmoe's filter of TensorStore's echoes
# of a failed read; the command-line test below shows the filter at work
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

ROOT = Path(__file__).parent.parent
CONFIG = {
    "model": {"d_model": 32, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
              "num_dense_layers": 1, "mlp_hidden": 64},
    "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32},
    "train": {"steps": 20, "batch_size": 8, "seq_len": 32, "eval_every": 0, "eval_batches": 1},
    "optimizer": {"warmup_steps": 2},
    "checkpoint": {"every": 10, "keep": 3},
    "logging": {"progress": False, "log_every": 10},
}


def _config(run: Path, **train) -> str:
    cfg = {**CONFIG, "train": {**CONFIG["train"], "run_dir": str(run), **train}}
    path = run.parent / f"{run.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of 20 steps with checkpoints at steps 10 and 20."""
    run = tmp_path_factory.mktemp("faults") / "run"
    assert train_main(["--config", _config(run)]) == 0
    assert checkpoint.complete_steps(checkpoint.checkpoint_dir(run)) == [10, 20]
    return run


def _copy(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


def _tree(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*")
            if p.is_file()}


# ---------------------------------------------------------------- a save that fails


def _limited_train(config: str) -> subprocess.CompletedProcess:
    """python -m jaxmoe.train with no file allowed past 200 kB (a checkpoint's data
    file is 0.5 MB): every checkpoint write fails as on a full disk, nothing else."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails, the process lives
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    env = {k: v for k, v in without_fake_devices(os.environ).items()
           if k != "JAX_COMPILATION_CACHE_DIR"}  # its entries could pass the limit too
    return subprocess.run([sys.executable, "-m", "jaxmoe.train", "--config", config],
                          preexec_fn=limit, env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("steps, failing", [(40, 30), (30, 30)])  # a periodic save, the final
def test_a_failed_save_stops_the_run_and_keeps_the_last_checkpoint(trained, tmp_path, steps,
                                                                   failing):
    run = _copy(trained, tmp_path)
    result = _limited_train(_config(run, steps=steps))
    errors = [line for line in result.stderr.splitlines() if not line.startswith("note:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert errors[0] == (f"error: saving checkpoint {failing} in {run / 'checkpoints'} failed: "
                         "File too large (errno 27); the last complete one, step 20, is kept")
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["10", "20"]  # nothing partial left
    assert _tree(ckpts) == _tree(trained / "checkpoints")
    # companion: the same command without the limit runs to the end
    again = subprocess.run([sys.executable, "-m", "jaxmoe.train", "--config",
                            _config(run, steps=steps)], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr
    assert checkpoint.complete_steps(ckpts)[-1] == steps


@pytest.mark.parametrize("tail", ["", " [source locations='file_util_posix.cc:370\\nfile.cc:1']"])
def test_a_failed_write_is_named_in_the_operating_system_s_words(tail):
    error = ('OUT_OF_RANGE: Error opening "zarr" driver: Error writing "a/.zarray" in OCDBT '
             'database at local file "/r/": Failed to write: "/r/d/0": File too large '
             f"[os_error_code='27']{tail}")
    assert checkpoint._reason([error]) == "File too large (errno 27)"
    # the save's writers fail in any order: the words are found in whichever error has
    # them, with the code or without
    assert checkpoint._reason(["ABORTED: cancelled", error]) == "File too large (errno 27)"
    assert checkpoint._reason(["ABORTED: cancelled", 'Failed writing: "/r/d/0": File too '
                               "large"]) == "File too large (errno 27)"
    # companion: errors without the system's words show the first one's first line
    assert checkpoint._reason(["INTERNAL: lost\nmore", "ABORTED: x"]) == "INTERNAL: lost"


# ---------------------------------------------------------------- damaged checkpoints

DAMAGE = {
    "state removed": lambda s: shutil.rmtree(s / "state"),
    "manifest truncated": lambda s: os.truncate(s / "state" / "manifest.ocdbt", 10),
    "array metadata removed": lambda s: (s / "state" / "_METADATA").unlink(),
    "data files truncated": lambda s: [os.truncate(f, 20) for f in
                                       (s / "state" / "ocdbt.process_0" / "d").iterdir()],
    "metadata not JSON": lambda s: (s / "meta" / "metadata").write_text("{"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_checkpoint_gives_way_to_the_last_good_one(trained, tmp_path, capfd, kind):
    """Resume, export and load_params take step 10 when step 20 is damaged, each saying
    so in one line (no traceback); the resumed run sets step 20 aside, untouched, and
    saves its own 20 and 30; metrics.jsonl holds each step once."""
    run = _copy(trained, tmp_path)
    DAMAGE[kind](run / "checkpoints" / "20")
    damaged = _tree(run / "checkpoints" / "20")
    skipping = f"skipping checkpoint {run / 'checkpoints' / '20'} is corrupt"

    export(run, tmp_path / "weights.safetensors")
    err = capfd.readouterr().err
    assert err.splitlines() == [line for line in err.splitlines() if line.startswith(skipping)]
    assert len(err.splitlines()) == 1, err
    from jaxmoe.api import load_params
    load_params(run)  # the same fallback, said once per process

    assert train_main(["--config", _config(run, steps=30)]) == 0
    out, err = capfd.readouterr()
    lines = err.splitlines()
    assert "Traceback" not in err and not any("Event loop" in line for line in lines), err
    assert lines[0].startswith("note: train.steps 20 -> 30: the cosine learning-rate schedule "
                               "now spans 30 steps; at step 10 the rate is"), err
    assert lines[1:] == [f"set aside damaged checkpoint {run / 'checkpoints' / '20'} as "
                         "20.damaged"], err
    assert "compiling and restoring from" in out and "resumed from step 10" in out
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["10", "20", "20.damaged", "30"]
    assert _tree(ckpts / "20.damaged") == damaged
    steps = [r["step"] for r in map(yaml.safe_load, (run / "metrics.jsonl").read_text().splitlines())
             if "loss" in r]
    assert steps == sorted(set(steps)) == [10, 20, 30]
    assert (run / "metrics.superseded.jsonl").exists()  # the first run's step 20


def test_refusing_a_damaged_checkpoint_instead(trained, tmp_path):
    """The command line, whole: one error line, exit 2, nothing touched (TensorStore's
    echoes of the failed read, which pytest would otherwise catch in-process, included)."""
    run = _copy(trained, tmp_path)
    DAMAGE["data files truncated"](run / "checkpoints" / "20")
    before = _tree(run)
    result = subprocess.run(
        [sys.executable, "-m", "jaxmoe.train", "--config", _config(run, steps=30),
         "--set", "checkpoint.skip_damaged=false"], cwd=ROOT, capture_output=True, text=True,
        env={**without_fake_devices(os.environ), "JAX_PLATFORMS": "cpu"}, timeout=600)
    errors = [line for line in result.stderr.splitlines() if not line.startswith("note:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert errors[0].startswith(
        f"error: checkpoint {run / 'checkpoints' / '20'} is corrupt or unreadable"), errors
    assert _tree(run) == before


def test_no_readable_checkpoint_is_one_line(trained, tmp_path, capfd):
    run = _copy(trained, tmp_path)
    for step in ("10", "20"):
        DAMAGE["metadata not JSON"](run / "checkpoints" / step)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in .* reads back"):
        checkpoint.load_weights(run / "checkpoints")
    assert capfd.readouterr().err == ""


# ---------------------------------------------------------------- other data


def test_resuming_on_other_data_is_refused_unless_asked(trained, tmp_path, capfd):
    run = _copy(trained, tmp_path)
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("other words, " * 4000)
    other = ["--set", "data.source=text", "--set", f"data.path={text}"]
    before = _tree(run)
    assert train_main(["--config", _config(run, steps=30), *other]) == 2
    err = capfd.readouterr().err.splitlines()
    assert len([line for line in err if line.startswith("error:")]) == 1, err
    assert "the data differ from those checkpoint" in err[-1]
    assert "--accept-new-data" in err[-1] and _tree(run) == before
    assert train_main(["--config", _config(run, steps=30), *other, "--accept-new-data"]) == 0
    assert "continuing on them from its position" in capfd.readouterr().err
    # companion: the same data resume without a word
    run = _copy(trained, tmp_path / "again")
    assert train_main(["--config", _config(run, steps=30)]) == 0
    assert "data differ" not in capfd.readouterr().err


# ---------------------------------------------------------------- a CPU-only start


def test_a_cpu_only_start_prints_no_gpu_traceback():
    """With the CUDA plugin installed (the test extra's GPU compiler) and no GPU, JAX
    logs the plugin's failed start as a traceback; a jaxmoe command does not (JAX then
    runs on the CPU either way)."""
    if not checkpoint.Path("/dev/nvidiactl").exists() and jax.default_backend() != "cpu":
        pytest.fail("a GPU backend without an NVIDIA device node")
    env = without_fake_devices(os.environ)
    env.pop("JAX_PLATFORMS", None)

    def stderr(code):
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300, cwd=ROOT).stderr

    bare = stderr("import jax; jax.devices()")
    quiet = stderr("import jaxmoe, jax; print(jax.devices())")
    assert "Traceback" not in quiet and "plugin configuration error" not in quiet, quiet
    if Path("/dev/nvidiactl").exists():
        return  # a GPU machine: nothing to quiet
    # companion: JAX alone prints it here
    assert "Jax plugin configuration error" in bare and "Traceback" in bare, bare
