"""End-to-end: the CLI trains on the default corpus; bad input fails cleanly."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxmoe.config import config_from_dict
from jaxmoe.data import load_corpus
from jaxmoe.train import main, train

SMALL = {
    "model": {"d_model": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "num_dense_layers": 1, "mlp_hidden": 128},
    "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 64},
    "train": {"steps": 60, "batch_size": 16, "seq_len": 64, "eval_every": 0, "eval_batches": 4,
              "microbatches": 2},
    "optimizer": {"learning_rate": 3e-3, "warmup_steps": 5},
    "checkpoint": {"every": 30},
    "logging": {"log_every": 10, "progress": False},
}


@pytest.mark.slow
def test_short_run_learns(tmp_path):
    cfg = config_from_dict({**SMALL, "train": {**SMALL["train"], "run_dir": str(tmp_path)}})
    corpus = load_corpus("stdlib", None, 256, 64)
    summary = train(cfg, corpus)
    assert summary["heldout_loss_initial"] > 5.0  # ~ln(256) at init
    assert summary["heldout_loss"] < summary["heldout_loss_initial"] - 2.0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(10, 61, 10))
    for key in ["loss", "ce", "balance_loss", "z_loss", "grad_norm", "lr", "tokens_per_s"]:
        assert np.isfinite(steps[-1][key])
    assert len(steps[-1]["load_max_over_mean"]) == 1 and len(steps[-1]["drop_fraction"]) == 1
    assert (tmp_path / "config.yaml").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["30", "60"]


def _cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "jaxmoe.train", *args],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)


@pytest.mark.parametrize("setup, args, message", [
    (None, ["--config", "missing.yaml"], "missing.yaml does not exist"),
    ("model: [oops", ["--config", "c.yaml"], "not valid YAML"),
    ("moe: {top_k: 99}", ["--config", "c.yaml"], "moe.top_k"),
    ("data: {source: text, path: nowhere.txt}", ["--config", "c.yaml"], "nowhere.txt"),
    ("data: {source: text, path: empty.txt}", ["--config", "c.yaml"], "empty.txt"),
    ("data: {source: tokens, path: big.bin}", ["--config", "c.yaml"], "vocab"),
    ("mesh: {data: 3}", ["--config", "c.yaml"], "mesh"),
    ("mesh: {expert: 16}\nmoe: {num_experts: 16}", ["--config", "c.yaml"], "mesh"),
])
def test_cli_bad_input(tmp_path, setup, args, message):
    if setup is not None:
        (tmp_path / "c.yaml").write_text(setup + "\ntrain: {run_dir: out}\n")
    (tmp_path / "empty.txt").write_text("")
    np.full(10_000, 300, np.uint16).tofile(tmp_path / "big.bin")
    result = _cli(tmp_path, *args)
    assert result.returncode == 2
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], result.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_main_rejects_bad_override(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("train: {run_dir: out}\n")
    assert main(["--config", str(tmp_path / "c.yaml"), "--set", "moe.num_experts=zero"]) == 2
    assert "moe.num_experts" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "cpu8_ep", "cpu8_pipeline"])
def test_shipped_config_trains(tmp_path, name):
    from pathlib import Path
    from jaxmoe.config import load_config
    path = Path(__file__).parent.parent / "configs" / f"{name}.yaml"
    cfg = load_config(path, ["train.steps=3", "optimizer.warmup_steps=1", "train.eval_batches=1",
                             f"train.run_dir={tmp_path}", "logging.progress=false",
                             "logging.log_every=1"])
    summary = train(cfg, load_corpus("stdlib", None, 256, cfg.train.seq_len))
    assert np.isfinite(summary["heldout_loss"])
