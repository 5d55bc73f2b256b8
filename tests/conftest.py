"""Eight fake CPU devices for every test, set before jax is imported; one XLA
compilation cache for the session; a shared tiny run. The helpers beside this file
(`tiny_tokenizer`, `one_device`, `poison`, ...) are importable from every test folder:
pytest puts this directory on the path with its conftest."""

import atexit
import importlib.util
import os
import shutil
import tempfile

import pytest

from jaxmoe.runtime.fake_devices import cpu_devices_env

os.environ.update(cpu_devices_env(os.environ, 8, force_cpu=False))

# XLA:CPU spends about half of a toy program's compile time in LLVM's optimisation
# passes (a 3-step tiny run: 23 s at the default level, 12.6 s at 0), and the suite's
# shapes are too small for optimised code to pay that back. HLO passes still run, so
# the programs whose collectives and buffers the tests read are the ones users get.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# Compiling dominates the suite's time, and many tests (and the training processes
# they start, which inherit the environment) compile the same programs. A cache set
# by the caller is kept; otherwise the session's own goes when it ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxmoe-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core this process may use, at most
    4 (each holds 8 fake devices and the compiler)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A 4-step run of a tiny MoE made by the training code (dense dispatch, router
    biases, TensorBoard events when tensorboardX is installed, a profiler trace of steps
    2-3); returns its run dir."""
    from jaxmoe.config import config_from_dict
    from jaxmoe.data.corpus import load_corpus
    from jaxmoe.train import train

    run_dir = tmp_path_factory.mktemp("tiny_run")
    cfg = config_from_dict({
        "model": {"d_model": 32, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
                  "num_dense_layers": 1, "mlp_hidden": 64},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "dispatcher": "dense",
                "expert_bias": True},
        "train": {"steps": 4, "batch_size": 8, "seq_len": 32, "eval_every": 0, "eval_batches": 2,
                  "run_dir": str(run_dir)},
        "optimizer": {"warmup_steps": 1},
        "logging": {"log_every": 1, "progress": False, "profile_steps": [2, 3],
                    "tensorboard": importlib.util.find_spec("tensorboardX") is not None},
    })
    train(cfg, load_corpus("stdlib", None, 256, cfg.train.seq_len))
    return run_dir
