"""python -m jaxmoe.train --config configs/tiny.yaml [--set section.key=value ...]"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np
import yaml

from jaxmoe import checkpoint
from jaxmoe.config import Config, ConfigError, load_config
from jaxmoe.data import BatchIterator, Corpus, DataError, heldout_batches, load_corpus
from jaxmoe.monitor import Monitor, to_python
from jaxmoe.sharding import make_mesh
from jaxmoe.step import build_steps


def evaluate(steps, state, batches: list[np.ndarray]) -> float:
    ces = [steps.eval_step(state, jax.device_put(b, steps.batch_sharding))["ce"] for b in batches]
    return float(np.mean(jax.device_get(ces)))


def train(cfg: Config, corpus: Corpus) -> dict:
    """Runs the configured job; returns the final summary (also printed)."""
    t = cfg.train
    mesh = make_mesh(cfg.mesh)
    steps = build_steps(cfg, mesh)
    run_dir = Path(t.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    state = steps.init(jax.random.PRNGKey(t.seed))
    batches = BatchIterator(corpus.train, t.batch_size, t.seq_len, seed=t.seed)
    eval_set = heldout_batches(corpus.heldout, t.batch_size, t.seq_len, t.eval_batches)
    manager = checkpoint.checkpoint_manager(run_dir, cfg)
    monitor = Monitor(run_dir, t.steps, 0, cfg.logging.progress)
    tokens_per_step = t.batch_size * t.seq_len
    initial_eval = evaluate(steps, state, eval_set)
    monitor.log({"step": 0, "eval_ce": initial_eval})

    last_time, last_step = time.perf_counter(), 0
    for step in range(1, t.steps + 1):
        state, metrics = steps.train_step(state, jax.device_put(next(batches), steps.batch_sharding))
        if step % cfg.logging.log_every == 0 or step == t.steps:
            record = {"step": step, **to_python(metrics)}  # waits for this step
            now = time.perf_counter()
            record["tokens_per_s"] = tokens_per_step * (step - last_step) / (now - last_time)
            monitor.log(record)
            monitor.progress(step - last_step, record)
            last_time, last_step = now, step
        if t.eval_every and step % t.eval_every == 0 and step != t.steps:
            monitor.log({"step": step, "eval_ce": evaluate(steps, state, eval_set)})
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            checkpoint.save(manager, state, batches.state(), cfg)
    final_eval = evaluate(steps, state, eval_set)
    monitor.log({"step": t.steps, "eval_ce": final_eval})
    checkpoint.save(manager, state, batches.state(), cfg)
    manager.wait_until_finished()
    monitor.close()
    summary = {"heldout_loss_initial": initial_eval, "heldout_loss": final_eval,
               "tokens_per_s": record["tokens_per_s"], "run_dir": str(run_dir.absolute())}
    print(f"held-out loss {final_eval:.4f} (from {initial_eval:.4f} at init); "
          f"outputs in {run_dir.absolute()} (metrics.jsonl, config.yaml, checkpoints/)")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxmoe.train", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set moe.num_experts=32")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        corpus = load_corpus(cfg.data.source, cfg.data.path, cfg.model.vocab_size,
                             cfg.train.seq_len, cfg.data.heldout_fraction, cfg.data.token_dtype)
        make_mesh(cfg.mesh)  # device-count errors before anything compiles
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    train(cfg, corpus)
    return 0


if __name__ == "__main__":
    sys.exit(main())
