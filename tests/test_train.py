"""End-to-end: the CLI trains on the default corpus; bad input fails cleanly;
Ctrl-C stops with a checkpoint that resumes."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxmoe import checkpoint
from jaxmoe.config import config_from_dict
from jaxmoe.data.corpus import load_corpus
from jaxmoe.train import main, train

SMALL = {
    "model": {"d_model": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "num_dense_layers": 1, "mlp_hidden": 128},
    "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 64},
    "train": {"steps": 60, "batch_size": 16, "seq_len": 64, "eval_every": 0, "eval_batches": 4,
              "accumulation_steps": 2},
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
    # Two context-free baselines from the data: a uniform guess over the byte values the
    # held-out text uses, and the training text's byte frequencies (3.2 nats on
    # CPython's stdlib). A run that learns is at least halfway from the first to the second.
    held = np.bincount(np.asarray(corpus.heldout[0]), minlength=256)
    freq = np.bincount(np.asarray(corpus.train[0].shards[0]), minlength=256)
    p_held, q_train = held / held.sum(), freq / freq.sum()
    unigram = -(p_held[held > 0] * np.log(q_train[held > 0])).sum()
    assert summary["heldout_loss"] < (np.log((held > 0).sum()) + unigram) / 2
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
@pytest.mark.parametrize("name", ["tiny", "cpu8_ep", "cpu8_pipeline", "deepseek_tiny"])
def test_shipped_config_trains(tmp_path, name):
    from jaxmoe.config import load_config
    path = Path(__file__).parent.parent / "configs" / f"{name}.yaml"
    cfg = load_config(path, ["train.steps=3", "optimizer.warmup_steps=1", "train.eval_batches=1",
                             "train.evals.limit=4",
                             f"train.run_dir={tmp_path}", "logging.progress=false",
                             "logging.log_every=1"])
    summary = train(cfg, load_corpus("stdlib", None, 256, cfg.train.seq_len))
    assert np.isfinite(summary["heldout_loss"])
    if cfg.model.mtp_layers:  # the prediction modules' loss, logged apart from the main one
        logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text()
                  .splitlines()]
        mtp = [r["mtp_ce"] for r in logged if "mtp_ce" in r]
        assert len(mtp) == 3 and all(np.isfinite(mtp))


def _logged_steps(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # a line being written has no newline yet
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.slow
def test_sigint_stops_with_a_checkpoint_that_resumes(tmp_path):
    """Ctrl-C ends the run after the step in flight, saves that step and exits 0;
    the same command then picks up from it."""
    tiny = {"model.d_model": 32, "model.num_layers": 2, "model.num_heads": 2,
            "model.num_kv_heads": 1, "model.mlp_hidden": 64, "moe.num_experts": 4,
            "moe.expert_hidden": 16, "moe.dispatcher": "dense", "train.batch_size": 8,
            "train.seq_len": 16, "train.eval_batches": 1, "train.eval_every": 0,
            "train.evals.tasks": [],
            "train.steps": 100_000,  # still running when the signal comes
            "optimizer.warmup_steps": 1, "checkpoint.every": 0, "logging.log_every": 1,
            "logging.progress": False, "train.run_dir": str(tmp_path)}
    cmd = [sys.executable, "-m", "jaxmoe.train", "--config",
           str(Path(__file__).parent.parent / "configs" / "tiny.yaml")]
    cmd += [a for k, v in tiny.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while len(_logged_steps(tmp_path)) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1]  # signalled mid-run, not after a crash
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "KeyboardInterrupt" not in err, err
    ckpts = checkpoint.checkpoint_dir(tmp_path)
    saved = checkpoint.complete_steps(ckpts)
    logged = _logged_steps(tmp_path)
    # one checkpoint, at the last step taken (every step is logged), short of the end
    assert len(saved) == 1 and saved[0] == logged[-1] and 3 <= saved[0] < tiny["train.steps"]
    stop = saved[0]
    assert f"stopped on SIGINT at step {stop}" in out
    again = subprocess.run(cmd + ["--resume", "--stop-after", "2"], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"resumed from step {stop}" in again.stdout
    assert _logged_steps(tmp_path) == logged + [stop + 1, stop + 2]
    assert checkpoint.complete_steps(ckpts) == [stop, stop + 2]


def test_heldout_loss_of_each_source(tmp_path):
    """A mixture's held-out loss per source (eval_ce/<source>, eval_bpb/<source>),
    each what the model's logits give on that source's held-out windows; eval_ce and
    eval_bpb weigh them as the mixture does. A learnable source and a noise one
    differ, and the weights move the total."""
    import math

    import jaxmoe
    from jaxmoe.data.batches import heldout_batches
    from jaxmoe.data.tokenizer import load_tokenizer
    from tiny_tokenizer import make_tokenizer, sentences

    tok = load_tokenizer(make_tokenizer(tmp_path / "tok"))
    prose = np.array(sum(tok.encode_documents(sentences(600)), []), np.uint16)
    prose.tofile(tmp_path / "prose.bin")
    (tmp_path / "noise").mkdir()
    np.random.default_rng(0).integers(0, 300, len(prose)).astype(np.uint16).tofile(
        tmp_path / "noise" / "0.bin")
    paths = [str(tmp_path / "prose.bin"), str(tmp_path / "noise" / "*.bin")]
    cfg = config_from_dict({
        "model": {"vocab_size": 300, "d_model": 32, "num_layers": 2, "num_heads": 2,
                  "num_kv_heads": 1, "num_dense_layers": 1, "mlp_hidden": 64},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "dispatcher": "dense"},
        "data": {"source": "tokens", "path": paths, "weights": [3.0, 1.0],
                 "tokenizer": str(tmp_path / "tok")},
        "train": {"steps": 12, "batch_size": 8, "seq_len": 32, "eval_every": 0,
                  "eval_batches": 2, "run_dir": str(tmp_path / "run")},
        "optimizer": {"warmup_steps": 2, "learning_rate": 1e-2},
        "logging": {"progress": False}})
    corpus = load_corpus("tokens", paths, 300, 32, weights=[3.0, 1.0])
    summary = train(cfg, corpus)
    params, local = jaxmoe.load_params(tmp_path / "run")
    for label, source in zip(["prose", "noise"], corpus.heldout_sources):
        nats = texts = 0.0
        for b in heldout_batches(source.shards, 8, 32, 2):
            logits = np.asarray(jaxmoe.apply(params, b[:, :-1], local)[0], np.float64)
            top = logits.max(-1, keepdims=True)
            logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
            nats -= np.take_along_axis(logp, b[:, 1:, None], -1).sum()
            texts += sum(len(tok._hf.decode(list(r[1:]), skip_special_tokens=True).encode())
                         for r in b)
        # 512 fp32 log-probabilities summed: 2^-16 relative bounds their rounding
        np.testing.assert_allclose(summary[f"eval_ce/{label}"], nats / (2 * 8 * 32), rtol=2.0 ** -16)
        np.testing.assert_allclose(summary[f"eval_bpb/{label}"], nats / math.log(2) / texts,
                                   rtol=2.0 ** -16)
    assert summary["eval_ce/noise"] > summary["eval_ce/prose"] + 0.5  # noise stays unlearnt
    np.testing.assert_allclose(summary["eval_ce"], (3 * summary["eval_ce/prose"]
                                                    + summary["eval_ce/noise"]) / 4, rtol=1e-12)
    # the mixture's bits per byte: its weighted nats over its weighted bytes
    per_byte = {k: summary[f"eval_ce/{k}"] / math.log(2) / summary[f"eval_bpb/{k}"]
                for k in ("prose", "noise")}  # text bytes per target
    np.testing.assert_allclose(summary["eval_bpb"], summary["eval_ce"] / math.log(2) / (
        (3 * per_byte["prose"] + per_byte["noise"]) / 4), rtol=1e-12)
    assert abs(summary["eval_ce"] - (summary["eval_ce/prose"] + summary["eval_ce/noise"]) / 2) > 0.1
    # a byte's worth: the prose's tokens are merges of several bytes
    assert summary["eval_bpb/prose"] < summary["eval_ce/prose"] / math.log(2)
