"""Faults lose nothing and say one line: a save that fails stops the run and keeps the
last complete checkpoint, a damaged checkpoint gives way to the newest older one that
reads back (set aside, never deleted), a resume on other data says so, and a CPU-only
start with the GPU compiler installed is quiet. Each case runs the commands a user
runs, on a tiny model."""

import json
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
from jaxmoe.runtime.fake_devices import without_fake_devices
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
    """python -m jaxmoe.train with no file allowed past 20 kB: every checkpoint write
    fails as on a full disk, nothing else (the logs stay under 10 kB). A checkpoint's
    data files are cut where its writes happen to be flushed (0.2 to 345 kB), so a
    limit above the smallest could let a save through; the file that holds one of its
    64 KiB arrays is never under 20 kB."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails, the process lives
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

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


def test_the_writers_a_failed_save_never_started_are_not_reported():
    """After a failed save, orbax's writer coroutines that were created but never run
    are collected and the interpreter warns of each ("coroutine ... was never
    awaited"): in any order with the error line, at exit or mid-run. Those drop out;
    a coroutine of anyone else's still warns."""
    script = (
        "import gc\n"
        "from jaxmoe import checkpoint\n"
        "from orbax.checkpoint._src.serialization import serialization\n"
        "checkpoint._quiet_failed_io()\n"
        "async def mine(): pass\n"
        "serialization.async_serialize_from_host(None, {})\n"
        "mine()\n"
        "gc.collect()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "coroutine 'mine' was never awaited" in result.stderr
    assert "async_serialize_from_host" not in result.stderr, result.stderr


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


# ---------------------------------------------------------------- one writer per run directory


def _train_cmd(config: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxmoe.train", "--config", config, *extra]


def _env() -> dict:
    return {**without_fake_devices(os.environ), "JAX_PLATFORMS": "cpu"}


def _trained_steps(run: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


@pytest.mark.slow
def test_a_second_training_in_a_run_directory_is_refused(trained, tmp_path):
    """While a training runs, another one into its run directory, started as it is or
    with --resume, stops in one line naming it, before compiling, and writes nothing;
    the first runs on to its end and leaves no lock. Companion: once it has ended, the
    same command trains (resuming from its checkpoint)."""
    import time

    from jaxmoe.runtime.run_lock import NAME

    run = _copy(trained, tmp_path)
    config = _config(run, steps=400)
    first = subprocess.Popen(_train_cmd(config), cwd=ROOT, env=_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lock = run / NAME
    deadline = time.monotonic() + 120
    while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert lock.exists(), first.communicate()
    metrics_before = (run / "metrics.jsonl").read_bytes()
    for extra in ((), ("--resume",)):
        second = subprocess.run(_train_cmd(config, *extra), cwd=ROOT, env=_env(),
                                capture_output=True, text=True, timeout=300)
        errors = [line for line in second.stderr.splitlines() if line.startswith("error")]
        assert second.returncode == 2 and len(errors) == 1, second.stderr
        assert errors[0].startswith(f"error: run directory {run} is in use by a training "
                                    "started ")
        assert f"pid {first.pid}," in errors[0] and "compiling" not in second.stdout
    while max(_trained_steps(run)) <= 20 and first.poll() is None:  # its loop has begun
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)  # end it early: it saves, releases, exits 128 + 15
    out, err = first.communicate(timeout=300)
    assert first.returncode == 128 + signal.SIGTERM, err
    assert not lock.exists()
    steps = _trained_steps(run)
    assert len(steps) == len(set(steps))  # each step once: nobody else wrote
    assert (run / "metrics.jsonl").read_bytes().startswith(metrics_before)
    again = subprocess.run(_train_cmd(_config(run, steps=checkpoint.complete_steps(
        run / "checkpoints")[-1] + 2)), cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=300)
    assert again.returncode == 0 and "resumed from step" in again.stdout, again.stderr


@pytest.mark.slow
def test_two_trainings_started_at_once_one_runs(tmp_path):
    """Two trainings started together into a new run directory: the lock is created
    exclusively, so exactly one trains (to its end, each step logged once) and the
    other stops in one line. Companion: each alone into its own directory trains."""
    run = tmp_path / "run"
    config = _config(run, steps=4)
    procs = [subprocess.Popen(_train_cmd(config), cwd=ROOT, env=_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    refused = next(err for p, (_, err) in zip(procs, outs) if p.returncode == 2)
    assert f"error: run directory {run} is in use by a training started " in refused
    steps = _trained_steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == 4
    assert checkpoint.complete_steps(run / "checkpoints") == [4]
    alone = subprocess.run(_train_cmd(_config(tmp_path / "alone", steps=4)), cwd=ROOT,
                           env=_env(), capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr


def test_a_stale_lock_is_taken_over_and_a_live_one_is_not(tmp_path):
    """A lock left by a process that is gone (this host) or untouched for STALE_S (any
    host) is taken over, saying so; one whose holder may be running is not. Readers
    (export, load_params) work beside a held lock."""
    import socket

    from jaxmoe.runtime.run_lock import STALE_S, RunDirectoryInUse, RunLock

    run = tmp_path / "run"
    run.mkdir()
    path = run / "training.lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = {"host": socket.gethostname(), "pid": int(dead), "token": "x", "started": "then",
             "command": "train"}
    path.write_text(json.dumps(stale))
    lock = RunLock(run)
    lock.acquire()
    assert lock.holder()["pid"] == os.getpid()
    lock.release()
    assert not path.exists()
    # another host's lock: live while touched, stale once untouched for STALE_S
    elsewhere = {**stale, "host": "another-host", "pid": 1}
    path.write_text(json.dumps(elsewhere))
    with pytest.raises(RunDirectoryInUse, match="in use by a training started then on host "
                       "another-host"):
        RunLock(run).acquire()
    os.utime(path, (os.path.getmtime(path) - STALE_S - 5,) * 2)
    lock = RunLock(run)
    lock.acquire()
    lock.release()
    # this host, a live holder (this process) is never taken over
    path.write_text(json.dumps({**stale, "pid": os.getpid()}))
    with pytest.raises(RunDirectoryInUse):
        RunLock(run).acquire()


def test_readers_work_beside_a_running_training(trained, tmp_path):
    """export and load_params read a run whose lock a live training holds."""
    import socket

    from jaxmoe.api import load_params

    run = _copy(trained, tmp_path)
    (run / "training.lock").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "token": "t", "started": "now",
         "command": "train"}))
    export(run, tmp_path / "w.safetensors")
    params, cfg = load_params(run)
    assert (tmp_path / "w.safetensors").stat().st_size > 0 and cfg.model.d_model == 32
    # companion: a training into it is refused
    assert train_main(["--config", _config(run, steps=30)]) == 2


# ---------------------------------------------------------------- a run directory that cannot be written


def test_an_unwritable_run_directory_is_one_line_before_compiling(tmp_path, capfd, monkeypatch):
    """A run directory that cannot be made, a checkpoints/ that cannot be written, a disk
    without room for one checkpoint: each one line and exit 2, nothing compiled."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert train_main(["--config", _config(tmp_path / "r1", **{}), "--set",
                       f"train.run_dir={blocker / 'run'}"]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"error: train.run_dir: {blocker / 'run'} cannot be written (") \
        and err.count("\n") == 1, err
    run = tmp_path / "r2"
    run.mkdir()
    (run / "checkpoints").write_text("")  # a file where the directory goes
    assert train_main(["--config", _config(run)]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"error: train.run_dir: {run / 'checkpoints'} cannot be written"), err
    import shutil as sh
    real = sh.disk_usage
    monkeypatch.setattr(sh, "disk_usage", lambda p: real(p)._replace(free=1000))
    assert train_main(["--config", _config(tmp_path / "r3")]) == 2
    out, err = capfd.readouterr()
    assert "has 0.00 GB free; a checkpoint of this run takes" in err and "compiling" not in out
    # companion: with room, the same config compiles and trains
    monkeypatch.undo()
    assert train_main(["--config", _config(tmp_path / "r3", steps=3)]) == 0
    assert "compiling" in capfd.readouterr().out


@pytest.mark.slow
def test_a_save_refused_as_it_starts_exits_within_seconds(trained, tmp_path):
    """A save refused as it starts (a read-only file system: EROFS when orbax makes the
    step's temporary directory; here a dangling link in its place, EEXIST) leaves
    orbax's writer threads waiting, which interpreter shutdown joins: the process
    printed its error and never exited. Companion: without `leave`, the same run
    is still there 10 s after its error."""
    for module, exits in ((["-m", "jaxmoe.train"], True),
                          (["-c", "import sys; from jaxmoe.train import main; sys.exit(main())"],
                           False)):
        run = _copy(trained, tmp_path / str(exits))
        (run / "checkpoints" / "30.orbax-checkpoint-tmp").symlink_to(tmp_path / "nowhere")
        proc = subprocess.Popen([sys.executable, *module, "--config", _config(run, steps=40)],
                                cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        error = next((line for line in proc.stderr if line.startswith("error:")), "")
        assert error.startswith("error: saving checkpoint 30 in ") and "File exists" in error
        try:
            assert proc.wait(timeout=10) == 2 and exits
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            assert not exits, "the run hung after its failed save"


# ---------------------------------------------------------------- an export killed midway

_KILLED_EXPORT = """
import os, signal, sys
from jaxmoe.export import export_hf
import jaxmoe.hf.checkpoint as hf  # where save_hf finds save_file
real = hf.save_file
def half_then_killed(tensors, path, metadata=None):
    real(tensors, path, metadata)
    with open(path, "r+b") as f:  # as a process killed mid-write leaves it
        f.truncate(os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)
hf.save_file = half_then_killed
export_hf(sys.argv[1], sys.argv[2])
"""


def test_an_export_killed_midway_leaves_the_old_one(trained, tmp_path):
    """`--format hf` over an earlier export, killed while writing its weights: the old
    export is still there whole, nothing of the new one is in it, and the next export
    clears what the killed one left. Companion: writing in place (as before), the same
    kill leaves a truncated shard beside the old config.json."""
    from jaxmoe.export import export_hf

    out = tmp_path / "hf"
    export_hf(trained, out)
    before = _tree(out)
    killed = subprocess.run([sys.executable, "-c", _KILLED_EXPORT,
                             str(trained), str(out)], cwd=ROOT, env=_env(), capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert _tree(out) == before
    assert [p.name for p in tmp_path.glob(".hf.partial-*")]  # what it left, hidden beside
    export_hf(trained, out)
    assert not list(tmp_path.glob(".hf.*")) and _tree(out) == before
    # companion: the kill in place
    in_place = tmp_path / "in_place"
    export_hf(trained, in_place)
    killed = subprocess.run([sys.executable, "-c", _KILLED_EXPORT.replace(
        "from jaxmoe.export import export_hf", "from jaxmoe import checkpoint").replace(
        "export_hf(sys.argv[1], sys.argv[2])",
        "w, cfg, _, _ = checkpoint.load_weights(*checkpoint.locate(sys.argv[1]))\n"
        "import jax, numpy as np\n"
        "hf.save_hf(jax.tree.map(np.asarray, w.to_pure_dict()), cfg, sys.argv[2])"),
        str(trained), str(in_place)], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    shard = next(in_place.glob("model-*.safetensors"))
    assert _tree(in_place) != _tree(out) and (in_place / "config.json").exists()
    assert shard.stat().st_size < (out / shard.name).stat().st_size
