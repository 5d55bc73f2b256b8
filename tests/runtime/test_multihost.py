"""Several processes on JAX's distributed runtime: real processes with 4 CPU devices each,
joined over loopback (gloo), against one process with 8 devices."""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from jaxmoe import checkpoint
from jaxmoe.config import ConfigError, MeshConfig, load_config
from jaxmoe.data.corpus import load_corpus
from jaxmoe.launch import free_port, process_env
from jaxmoe.parallel.sharding import AXES, device_grid, make_mesh, mesh_shape, process_rows
from jaxmoe.runtime.distributed import DistributedError, PeerWatch, Processes, add_arguments, settings
from jaxmoe.step import build_steps
from jaxmoe.train import main, train

CONFIG = Path(__file__).parents[2] / "configs" / "cpu8_ep.yaml"
TINY = ["train.steps=4", "optimizer.warmup_steps=1", "train.batch_size=16", "train.seq_len=32",
        "model.d_model=32", "model.mlp_hidden=64", "model.num_layers=2", "moe.expert_hidden=32",
        "train.eval_batches=2", "train.eval_every=0", "logging.log_every=1",
        "logging.progress=false", "checkpoint.every=2"]
# For tests of stopping, where the model does not matter: one dense layer compiles fastest.
DENSE = TINY + ["model.num_layers=1", "model.num_dense_layers=1", "train.eval_batches=1",
                "train.steps=400", "checkpoint.every=1000"]


def _settings(argv, environ):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings(parser.parse_args(argv), environ)


# --- settings -----------------------------------------------------------------------------

def test_settings_sources():
    assert _settings([], {}) is None
    flags = ["--coordinator", "10.0.0.1:1234", "--num-processes", "4", "--process-id", "3"]
    assert _settings(flags, {}) == Processes(4, 3, "10.0.0.1:1234", 120, "flags / JAXMOE_* variables")
    env = {"JAXMOE_COORDINATOR": "h:9", "JAXMOE_NUM_PROCESSES": "2", "JAXMOE_PROCESS_ID": "1",
           "JAXMOE_PEER_TIMEOUT": "7"}
    assert _settings([], env) == Processes(2, 1, "h:9", 7, "flags / JAXMOE_* variables")
    assert _settings(["--process-id", "0"], env).process_id == 0  # flags win over the environment
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[01-04]", "SLURM_NTASKS": "32",
             "SLURM_PROCID": "9", "SLURM_LOCALID": "1"}
    assert _settings([], slurm) == Processes(32, 9, None, 120, "SLURM")
    assert _settings([], {**slurm, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert _settings([], {**slurm, **env}).coordinator == "h:9"
    mpi = {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:5", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_RANK": "1"}
    assert _settings([], mpi) == Processes(2, 1, None, 120, "Open MPI")
    assert _settings(["--coordinator", "h:1", "--num-processes", "1", "--process-id", "0"],
                     {}) is None


@pytest.mark.parametrize("argv, message", [
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
     "process id 2 not in 0..1"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "-1"], "process id -1"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
     "--coordinator must be HOST:PORT"),
    (["--coordinator", "h:99999", "--num-processes", "2", "--process-id", "0"], "'h:99999'"),
    (["--coordinator", "h:1", "--num-processes", "two", "--process-id", "0"],
     "--num-processes must be an integer, got 'two'"),
    (["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"], "at least 1, got 0"),
    (["--coordinator", "h:1"], "missing --num-processes (JAXMOE_NUM_PROCESSES), --process-id"),
    (["--peer-timeout", "0"], "--peer-timeout must be at least 1 second"),
])
def test_bad_settings(argv, message):
    with pytest.raises(DistributedError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _settings(argv, {})


def test_cli_rejects_bad_settings_before_anything(tmp_path, capsys):
    code = main(["--config", str(CONFIG), "--set", f"train.run_dir={tmp_path / 'out'}",
                 "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "5"])
    assert code == 2 and "process id 5 not in 0..1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --- mesh and rows ------------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    id: int
    process_index: int


def _hosts(processes, per_process):
    devices = [Device(p * 1000 + i, p) for p in range(processes) for i in range(per_process)]
    return [devices[i] for i in np.random.default_rng(0).permutation(len(devices))]


def test_device_grid_keeps_expert_groups_in_one_host():
    grid = device_grid({"data": 2, "stage": 1, "context": 1, "expert": 4}, _hosts(2, 4))
    hosts = np.vectorize(lambda d: d.process_index)(grid)
    assert hosts.tolist() == [[[[0] * 4]], [[[1] * 4]]]  # each data replica is one host's
    assert [d.id for d in grid[0, 0, 0]] == [0, 1, 2, 3]
    grid = device_grid({"data": 2, "stage": 2, "context": 1, "expert": 2}, _hosts(4, 2))
    assert np.vectorize(lambda d: d.process_index)(grid).reshape(4, 2).tolist() == \
        [[0, 0], [1, 1], [2, 2], [3, 3]]
    # an expert group bigger than a host spans whole adjacent hosts
    grid = device_grid({"data": 2, "stage": 1, "context": 1, "expert": 8}, _hosts(4, 4))
    assert np.vectorize(lambda d: d.process_index)(grid)[:, 0, 0].tolist() == \
        [[0] * 4 + [1] * 4, [2] * 4 + [3] * 4]
    # a context x expert group of a host's size stays on it, expert groups innermost
    grid = device_grid({"data": 2, "stage": 1, "context": 2, "expert": 2}, _hosts(2, 4))
    assert np.vectorize(lambda d: d.process_index)(grid)[:, 0].tolist() == \
        [[[0, 0], [0, 0]], [[1, 1], [1, 1]]]
    assert [[d.id for d in ranks] for ranks in grid[0, 0]] == [[0, 1], [2, 3]]


def test_device_grid_errors():
    with pytest.raises(ConfigError, match="stage x expert = 4 devices neither divides the 6"):
        device_grid({"data": 3, "stage": 1, "context": 1, "expert": 4}, _hosts(2, 6))
    with pytest.raises(ConfigError, match=r"different numbers of devices \[3, 5\]"):
        device_grid({"data": 1, "stage": 1, "context": 1, "expert": 8},
                    _hosts(1, 3) + [Device(1000 + i, 1) for i in range(5)])
    with pytest.raises(ConfigError, match="but the 2 processes hold 8 together"):
        mesh_shape(MeshConfig(data=4, expert=4), 8, 2)


def test_one_process_reads_whole_batch():
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    assert mesh.axis_names == AXES
    steps = build_steps(load_config(CONFIG, TINY), mesh)
    assert process_rows(steps.batch_sharding, 16) == (0, 1)


# --- end to end ---------------------------------------------------------------------------

def _records(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r}


def _evals(run_dir):
    return [(r["step"], r["eval_ce"]) for r in _records(run_dir) if "eval_ce" in r]


def _train_in_this_process(run_dir):
    cfg = load_config(CONFIG, TINY + [f"train.run_dir={run_dir}"])
    return train(cfg, load_corpus("stdlib", None, 256, cfg.train.seq_len))


def _launch_cmd(run_dir, overrides, *args):
    cmd = [sys.executable, "-m", "jaxmoe.launch", "--num-processes", "2",
           "--devices-per-process", "4", "--", "--config", str(CONFIG), *args]
    return cmd + [a for o in overrides + [f"train.run_dir={run_dir}"] for a in ("--set", o)]


def _launch(run_dir, *args):
    return subprocess.run(_launch_cmd(run_dir, TINY, *args), capture_output=True, text=True,
                          timeout=300)


def _wait_for_steps(run_dir, n, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(_losses(run_dir)) >= n:
            return
        time.sleep(0.1)
    raise TimeoutError(f"fewer than {n} steps logged in {timeout} s")


def _copy_checkpoint(src_run, dst_run, step):
    shutil.copytree(checkpoint.checkpoint_dir(src_run) / str(step),
                    checkpoint.checkpoint_dir(dst_run) / str(step))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process with 8 devices, data 2 x expert 4."""
    run = tmp_path_factory.mktemp("one")
    _train_in_this_process(run)
    return run


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    run = tmp_path_factory.mktemp("two")
    result = _launch(run)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run, result.stdout


def _assert_same_losses(got, want, steps):
    assert sorted(got) == list(steps) and steps
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)


@pytest.mark.slow
def test_two_processes_match_one(one_process, two_processes):
    run, out = two_processes
    # the mesh really spans both processes, each reading its own half of every batch
    assert ("[0] 2 processes x 4 devices, mesh data=2 x stage=1 x expert=4; of each batch of 16: "
            "process 0 rows 0:8, process 1 rows 8:16") in out
    _assert_same_losses(_losses(run), _losses(one_process), range(1, 5))
    got, want = _evals(run), _evals(one_process)
    assert [s for s, _ in got] == [s for s, _ in want] == [0, 4]
    np.testing.assert_allclose([c for _, c in got], [c for _, c in want], rtol=1e-5)
    # only process 0 writes: one line per record, one final message
    assert len(_records(run)) == len(_records(one_process))
    assert "[0] held-out loss" in out and "[1] held-out" not in out
    assert checkpoint.complete_steps(checkpoint.checkpoint_dir(run)) == [2, 4]


@pytest.mark.slow
def test_checkpoint_from_two_processes_resumes_in_one(one_process, two_processes, tmp_path):
    _copy_checkpoint(two_processes[0], tmp_path, 2)
    summary = _train_in_this_process(tmp_path)
    assert summary["step"] == 4
    _assert_same_losses(_losses(tmp_path), _losses(one_process), range(3, 5))


@pytest.mark.slow
def test_checkpoint_from_one_process_resumes_in_two(one_process, tmp_path):
    _copy_checkpoint(one_process, tmp_path, 2)
    result = _launch(tmp_path, "--resume")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[0] resumed from step 2" in result.stdout and "process 1 rows 8:16" in result.stdout
    _assert_same_losses(_losses(tmp_path), _losses(one_process), range(3, 5))


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_both_at_one_step(tmp_path):
    proc = subprocess.Popen(_launch_cmd(tmp_path, DENSE), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for_steps(tmp_path, 3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    # stopped by a signal, not finished: 128 + SIGTERM, so `train && export` stops too
    assert proc.returncode == 143, out[-3000:] + err[-3000:]
    steps = checkpoint.complete_steps(checkpoint.checkpoint_dir(tmp_path))
    assert len(steps) == 1 and 3 <= steps[0] < 400
    assert f"[0] stopped on SIGTERM at step {steps[0]}" in out


def _start_processes(run_dirs, overrides, peer_timeout=20):
    """Two processes started by hand, as a cluster scheduler would."""
    port = free_port()
    procs = []
    for i, run_dir in enumerate(run_dirs):
        env = {**process_env(i, 2, port, 4), "JAXMOE_PEER_TIMEOUT": str(peer_timeout)}
        cmd = [sys.executable, "-m", "jaxmoe.train", "--config", str(CONFIG)]
        cmd += [a for o in overrides + [f"train.run_dir={run_dir}"] for a in ("--set", o)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_at_one_step(tmp_path):
    """A scheduler may signal a single task: the processes agree to stop together."""
    procs = _start_processes([tmp_path] * 2, DENSE)
    _wait_for_steps(tmp_path, 3)
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [143, 143], [e[-2000:] for _, e in outs]
    steps = checkpoint.complete_steps(checkpoint.checkpoint_dir(tmp_path))
    assert len(steps) == 1 and 3 <= steps[0] < 400
    assert f"stopped on a signal to another process at step {steps[0]}" in outs[0][0]


@pytest.mark.slow
@pytest.mark.parametrize("victim, message", [
    (1, "error: process 1 of 2 has been silent for "),
    (0, None),
])
def test_a_dead_process_stops_the_other_in_one_line(tmp_path, victim, message):
    """No launcher to clean up: the survivor stops within half its peer timeout, with
    one line, and gives the run directory back."""
    procs = _start_processes([tmp_path] * 2, DENSE, peer_timeout=8)
    _wait_for_steps(tmp_path, 2)
    assert all(p.poll() is None for p in procs), "training ended before the kill"
    procs[victim].kill()
    killed = time.time()
    survivor = procs[1 - victim]
    _, err = survivor.communicate(timeout=60)
    waited = time.time() - killed
    procs[victim].communicate()
    assert waited < 8 / 2 + 10, f"survivor took {waited:.0f} s to stop"
    if message is None:  # process 0 held the store: JAX aborts the rest at once, its way
        assert survivor.returncode != 0 and "the leader task was preempted/died" in err
        return
    assert survivor.returncode == 2, err[:3000]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), err[-3000:]
    # companion: JAX's own abort (its heartbeat timeout) prints the coordination
    # service's log, which the one line comes before
    assert "heartbeat" not in err.lower() and "Terminating process" not in err, err[-3000:]
    assert not (tmp_path / "training.lock").exists()  # process 0, its holder, let it go


class _Store:
    """The coordination service's key-value store as PeerWatch uses it."""

    def __init__(self):
        self.kv, self.lock = {}, threading.Lock()

    def key_value_increment(self, key, n):
        with self.lock:
            self.kv[key] = str(int(self.kv.get(key, "0")) + n)

    def key_value_set(self, key, value):
        with self.lock:
            self.kv[key] = value

    def key_value_try_get(self, key):
        with self.lock:
            if key not in self.kv:
                raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
            return self.kv[key]

    def key_value_dir_get(self, prefix):
        with self.lock:
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix + "/")]


@pytest.mark.parametrize("lost", [None, 2])
def test_a_silent_process_stops_every_other_in_one_line(lost, capfd):
    """Three processes beat; process 2 falls silent (no `done`): process 0 writes why
    and leaves after process 1, which read it; each prints one line and runs its
    cleanups. Companion: with every process beating, or finished, nobody stops."""
    store, stopped = _Store(), []
    watches = [PeerWatch(store, i, 3, silence_s=0.3) for i in range(3)]
    for w in watches:
        w.BEAT_S, w.silence_s = 0.05, 0.3
        w.exit = lambda code, w=w: stopped.append((w.me, code))
        w.on_stop(lambda w=w: stopped.append((w.me, "cleanup")))
        w.start()
    time.sleep(0.3)
    if lost is not None:
        watches[lost].exit = lambda code: None
        watches[lost]._finished.set()  # its beats stop, as a killed process's would
    time.sleep(1.5)
    for w in watches:
        w.done()
    if lost is None:
        assert stopped == [] and capfd.readouterr().err == ""
        return
    assert stopped == [(1, "cleanup"), (1, 2), (0, "cleanup"), (0, 2)]
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 2 and err[0] == err[1] and err[0].startswith(
        "error: process 2 of 3 has been silent for "), err


@pytest.mark.slow
def test_a_process_that_never_joins_stops_the_other(tmp_path):
    start = time.time()
    (proc,) = _start_processes([tmp_path], TINY, peer_timeout=3)  # process 0 of 2, alone
    _, err = proc.communicate(timeout=90)
    assert proc.returncode != 0 and time.time() - start < 3 + 40
    assert "DEADLINE_EXCEEDED" in err and "RegisterTask" in err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_unshared_run_directory_is_refused(one_process, tmp_path):
    """Each process must see the same checkpoints, or they would restore different states."""
    _copy_checkpoint(one_process, tmp_path / "a", 2)
    procs = _start_processes([tmp_path / "a", tmp_path / "b"], TINY)
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    for err in errs:
        assert "processes disagree on the latest checkpoint step" in err
        assert "process 0 has 2, process 1 has -1" in err


@pytest.mark.slow
def test_launcher_stops_the_rest_and_names_the_failed_process(tmp_path):
    proc = subprocess.Popen(_launch_cmd(tmp_path, DENSE), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert first.startswith("jaxmoe.launch: 2 processes x 4 CPU devices"), first
    pids = [int(p) for p in first.split("pids")[1].split()]
    os.kill(pids[1], signal.SIGKILL)
    start = time.time()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and time.time() - start < 15
    assert "process 1 of 2 failed with signal SIGKILL" in err
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)  # the other one is gone too
