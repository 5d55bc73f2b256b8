"""python -m jaxmoe.train --config configs/tiny.yaml [--set section.key=value ...] [--resume]

A run resumes by itself from the latest complete checkpoint in its run
directory; `--resume` insists that there is one. The same command runs as one of
several processes (see `jaxmoe.runtime.distributed`); process 0 writes the logs.

Before anything compiles, process 0 checks that it can write the run directory,
with room for a checkpoint, and takes its lock (`jaxmoe.runtime.run_lock`): one training
per run directory. A checkpoint is never saved from inside a streak of skipped
non-finite steps, and one whose weights started a streak that stops the run is
set aside as diverged.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import yaml
from absl import logging as absl_logging

from jaxmoe import checkpoint, hf
from jaxmoe.checkpoint import CheckpointError
from jaxmoe.config import Config, ConfigError, load_config
from jaxmoe.plan.counts import flops_per_token
from jaxmoe.data.batches import BatchIterator, Prefetcher
from jaxmoe.data.corpus import Corpus, DataError, load_corpus
from jaxmoe.data.tokenizer import RUN_SUBDIR, TokenizerError, check_vocab, load_tokenizer
from jaxmoe.eval import heldout
from jaxmoe.observe import sinks
from jaxmoe.observe.monitor import Monitor, to_python
from jaxmoe.observe.perf import Peak, ProfileWindow, StepClock, memory, throughput
from jaxmoe.optim.muon import describe
from jaxmoe.optim.schedules import learning_rate_schedule
from jaxmoe.parallel.sharding import make_mesh, process_rows
from jaxmoe.runtime import distributed
from jaxmoe.runtime.distributed import DistributedError
from jaxmoe.runtime.run_lock import RunDirectoryInUse, RunLock
from jaxmoe.step import abstract_model, build_steps, with_weights
from jaxmoe.step.overflow import Overflow, OverflowSteps


class TooManyBadSteps(RuntimeError):
    pass


def global_batch(steps, rows_bxL1: np.ndarray) -> jax.Array:
    """The global batch, sharded for the step, from this process's rows of it."""
    shape = (steps.cfg.train.batch_size, rows_bxL1.shape[1])
    return jax.make_array_from_process_local_data(steps.batch_sharding, rows_bxL1, shape)


def check_resumable(cfg: Config, require: bool) -> None:
    """Before anything is written: a checkpoint to resume must fit this config."""
    directory = checkpoint.checkpoint_dir(cfg.train.run_dir)
    if not checkpoint.complete_steps(directory):
        if require:
            raise CheckpointError(f"--resume: no complete checkpoint in {directory}")
        return
    step, meta = checkpoint.read_meta(directory, fall_back=cfg.checkpoint.skip_damaged)
    checkpoint.check_compatible(meta["config"], cfg, directory / str(step))
    if "no_decay" not in meta["config"].get("optimizer", {}):
        print(f"note: checkpoint {directory / str(step)} was saved when every tensor of 2 or more "
              "dimensions decayed; from here on optimizer.no_decay "
              f"{list(cfg.optimizer.no_decay)} and stacked norm scales do not", file=sys.stderr)


def schedule_note(saved: Config, cfg: Config, step: int) -> str:
    """What a changed `train.steps` does to the learning rate of a resumed run: the
    schedule is the new config's, from the step the checkpoint reached."""
    old = learning_rate_schedule(saved.optimizer, saved.train.steps)
    new = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    return (f"note: train.steps {saved.train.steps} -> {cfg.train.steps}: the {cfg.optimizer.schedule}"
            f" learning-rate schedule now spans {cfg.train.steps} steps; at step {step} the rate "
            f"is {float(new(step)):.3g} (it was {float(old(step)):.3g} on the old schedule)")


def data_of(batches, corpus: Corpus) -> dict:
    """What a checkpoint records of the data: the iterator's position, and the corpus's
    fingerprint (which data that position is in)."""
    return {**batches.state(), "fingerprint": corpus.fingerprint}


def check_same_data(data_state: dict, corpus: Corpus, where: Path, accept: bool) -> None:
    """A resume on other data than the checkpoint's is refused in one line, unless
    asked for (`--accept-new-data`): its position would point into other batches."""
    saved = data_state.get("fingerprint")  # None: saved before checkpoints recorded it
    if saved is None or saved == corpus.fingerprint:
        return
    line = (f"the data differ from those checkpoint {where} trained on (fingerprint "
            f"{corpus.fingerprint}, the checkpoint's {saved})")
    if not accept:
        raise DataError(f"{line}; --accept-new-data continues on them from its position")
    print(f"note: {line}; continuing on them from its position (--accept-new-data)",
          file=sys.stderr)


class StopSignals:
    """SIGTERM / SIGINT end the run after the current step, with a final checkpoint.

    Several processes must stop at the same step: they compare notes at logged steps.
    """

    def __enter__(self):
        self.received = None
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def checkpoint_bytes(steps) -> int:
    """Bytes of one checkpoint of this run: the whole train state, as orbax writes it."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(checkpoint.abstract_target(steps)))


def check_writable(run_dir: Path, need: int) -> None:
    """Before anything compiles: the run directory and its checkpoints/ can be written,
    with room for one checkpoint of `need` bytes; else one line (CheckpointError)."""
    where = [run_dir, checkpoint.checkpoint_dir(run_dir)]
    for directory in where:
        if not directory.exists():
            continue
        probe = directory / f".write-test-{os.getpid()}"
        times = directory.stat()
        try:
            probe.write_bytes(b"")
            probe.unlink()
            # a resume refused later leaves the directory as it found it
            os.utime(directory, ns=(times.st_atime_ns, times.st_mtime_ns))
        except OSError as e:
            raise _unwritable(directory, e) from None
    free = shutil.disk_usage(next(d for d in reversed(where) if d.exists())).free
    if free < need:
        raise CheckpointError(f"train.run_dir: {run_dir} has {free / 1e9:.2f} GB free; a "
                              f"checkpoint of this run takes {need / 1e9:.2f} GB")


def _unwritable(directory: Path, e: OSError) -> CheckpointError:
    return CheckpointError(f"train.run_dir: {directory} cannot be written ({e.strerror or e})")


def take_run_dir(steps) -> RunLock | None:
    """One training per run directory: process 0 takes its lock (`jaxmoe.runtime.run_lock`)
    before anything is written, after checking it can write there; every process
    stops if it cannot. Returns the lock to release (None on other processes)."""
    run_dir = Path(steps.cfg.train.run_dir).absolute()
    lock, refused = None, None
    if distributed.is_main():
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            check_writable(run_dir, checkpoint_bytes(steps))
            lock = RunLock(run_dir)
            lock.acquire()
            distributed.on_stop(lock.release)  # a lost peer ends this process past `finally`
        except OSError as e:
            refused = _unwritable(run_dir, e)
        except (CheckpointError, RunDirectoryInUse) as e:
            refused = e
    if distributed.any_process(refused is not None):
        raise refused or RunDirectoryInUse(f"run directory {run_dir}: process 0 could not "
                                           "take it (its error says why)")
    return lock


def diverged(directory: Path, step: int, streak: int, max_bad_steps: int) -> str:
    """The stop message of a run whose last `streak` steps up to `step` were all
    non-finite: the weights of step `step - streak` gave every one of them, so any
    checkpoint from that step on holds them; those are set aside (`STEP.diverged`,
    kept, never resumed from) and the message names the newest good one."""
    bad = [s for s in checkpoint.complete_steps(directory) if s >= step - streak]
    if distributed.is_main():
        for s in bad:
            checkpoint.set_aside(directory, s, "diverged")
    kept = [s for s in checkpoint.complete_steps(directory) if s < step - streak]
    line = (f"{streak} consecutive steps up to {step} had a non-finite loss or gradient "
            f"(train.max_bad_steps={max_bad_steps}), from the weights of step {step - streak}; "
            "stopped")
    if bad:
        line += (f"; checkpoint{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} "
                 f"set aside as diverged ({directory}/STEP.diverged)")
    return line + (f"; the newest good checkpoint, step {kept[-1]}, is kept in {directory}"
                   if kept else "; no good checkpoint: a rerun starts from step 0")


def set_aside_note(directory: Path, step: int) -> str:
    """The checkpoints newer than `step` set aside as diverged, for the resume line."""
    newer = sorted(int(m.group(1)) for p in directory.glob("*.diverged*")
                   if (m := re.match(r"(\d+)\.diverged", p.name)) and int(m.group(1)) > step)
    return (f" (newer checkpoint{'s' if len(newer) > 1 else ''} "
            f"{', '.join(map(str, newer))} set aside as diverged)") if newer else ""


def train(cfg: Config, corpus: Corpus, stop_after: int | None = None,
          init_weights: dict | None = None, accept_new_data: bool = False) -> dict:
    """Runs (or resumes) the configured job; returns the final summary (also printed).

    stop_after: leave after this many steps of this process, with a checkpoint
    (for time-limited allocations). init_weights: start from these weights (a plain
    dict in model order, e.g. `jaxmoe.hf.load_hf`'s) instead of the seed's; a run
    that resumes ignores them. accept_new_data: resume on a corpus other than the
    checkpoint's (else refused). A run stopped by a signal returns with
    `stopped_by` (the signal's name) in its summary.
    """
    t = cfg.train
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tokenizer, cfg.model.vocab_size)
    corpus.check_tokenizer(tokenizer.describe())
    BatchIterator(corpus.train, t.batch_size, t.seq_len, seed=t.seed)  # data errors before compiling
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    lock = take_run_dir(steps)
    try:
        return _train(cfg, corpus, steps, tokenizer, stop_after, init_weights, accept_new_data)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: Config, corpus: Corpus, steps, tokenizer, stop_after: int | None,
           init_weights: dict | None, accept_new_data: bool) -> dict:
    """`train` once the run directory is this process's."""
    t = cfg.train
    downstream = None
    if t.evals.tasks:  # lm-eval is an extra: imported only when tasks are asked for
        from jaxmoe.eval.downstream import Downstream
        downstream = Downstream(cfg, steps, tokenizer)
    run_dir = Path(t.run_dir)
    ckpt_dir = checkpoint.checkpoint_dir(run_dir)
    main = distributed.is_main()
    state, data_state, start = _start(cfg, corpus, steps, tokenizer, init_weights,
                                      accept_new_data, ckpt_dir, main)
    block, blocks = process_rows(steps.batch_sharding, t.batch_size)
    batches = BatchIterator(corpus.train, t.batch_size, t.seq_len, seed=t.seed,
                            process_index=block, process_count=blocks,
                            start_step=data_state["step"])
    eval_sets, too_short = heldout.heldout_sets(corpus, tokenizer, t.batch_size, t.seq_len,
                                                t.eval_batches)

    def evaluations(state, losses: bool, tasks: bool) -> dict:
        record = heldout.evaluate(steps, state, eval_sets) if losses else {}
        return record | (downstream(state) if tasks and downstream else {})

    summary = {"run_dir": str(run_dir.absolute())}
    # the monitor and the saver close on every way out; the saver first, so that the
    # last save is complete before the final evaluation is logged
    with Monitor(run_dir, t.steps, start, cfg.logging.progress,
                 sinks.open_sinks(cfg, run_dir, resuming=start > 0), active=main) as monitor:
        if jax.process_count() > 1:
            monitor.write(distributed.layout(steps.batch_sharding, t.batch_size))
        if too_short:
            monitor.write(f"no held-out loss of {', '.join(too_short)}: no held-out shard of "
                          f"seq_len + 1 = {t.seq_len + 1} tokens")
        for note in downstream.notes if downstream else []:
            monitor.write(note)
        if start:
            monitor.write(f"resumed from step {start} in {ckpt_dir}"
                          f"{set_aside_note(ckpt_dir, start)}")
        else:
            first = evaluations(state, True, True)
            summary["heldout_loss_initial"] = first["eval_ce"]
            monitor.log({"step": 0, **first})
        peak = Peak.of(steps.mesh.devices.flat)
        kind = steps.mesh.devices.flat[0].device_kind
        monitor.write("MFU against " + (peak.source if peak else f"no known peak for {kind}"))
        profile = ProfileWindow(run_dir / "profile", cfg.logging.profile_steps)
        if profile.span and start >= profile.span[1]:
            monitor.write(f"logging.profile_steps {list(profile.span)}: this run resumes after "
                          "the window; no trace")
        train_step = OverflowSteps(steps)  # moe.on_overflow
        clock, last_step, record, stop = StepClock(), start, {}, None
        save_due = False  # a checkpoint waits out a streak of non-finite steps
        end = t.steps if stop_after is None else min(t.steps, start + stop_after)
        if cfg.data.prefetch:  # started last: nothing that could fail comes between it and its end
            batches = Prefetcher(batches, cfg.data.prefetch)
        with checkpoint.Saver(run_dir, cfg) as saver:
            # the prefetch thread ends with the loop
            with StopSignals() as signals, batches, profile:
                for step in range(start + 1, end + 1):
                    with clock.timed("data"):
                        batch = global_batch(steps, next(batches))
                    if profile.starts_at(step):
                        jax.block_until_ready(state)
                        profile.start()
                    with profile.annotate(step):
                        # moe.on_overflow: raise ends the run here; the last checkpoint stays
                        state, metrics = train_step(state, batch)
                    saver.check()  # a failed save in the background ends the run here
                    if profile.ends_at(step):
                        jax.block_until_ready(state)
                        with clock.timed("host"):  # writing the trace files
                            profile.stop()
                    if step % cfg.logging.log_every == 0 or step == end:
                        record = {"step": step, **to_python(metrics)}  # waits for this step
                        times = clock.split(step - last_step)
                        with clock.timed("host"):
                            record |= measured(cfg, steps, peak, times, batches.progress(step))
                            monitor.log(record)
                            monitor.progress(step - last_step, record)
                        last_step = step
                        if record["bad_steps"] >= t.max_bad_steps:
                            saver.finish()  # the message names the checkpoints it leaves
                            raise TooManyBadSteps(diverged(ckpt_dir, step, int(record["bad_steps"]),
                                                           t.max_bad_steps))
                    with clock.timed("host"):
                        losses = bool(t.eval_every) and step % t.eval_every == 0 and step != t.steps
                        tasks = downstream is not None and downstream.due(step) and step != t.steps
                        if losses or tasks:
                            monitor.log({"step": step, **evaluations(state, losses, tasks)})
                        save_due |= bool(cfg.checkpoint.every) and step % cfg.checkpoint.every == 0
                        if save_due and step != end:
                            save_due = not saver.save_good(state, data_of(batches, corpus), steps)
                    check = jax.process_count() == 1 or step % cfg.logging.log_every == 0
                    if check and distributed.any_process(signals.received is not None):
                        stop = signals.received or "a signal to another process"
                        break
            if int(state.step) not in saver.all_steps() and not saver.save_good(
                    state, data_of(batches, corpus), steps) and main:
                kept = checkpoint.complete_steps(ckpt_dir)
                print(f"no checkpoint of step {int(state.step)}: its weights gave the last "
                      f"{int(state.bad_steps)} steps a non-finite loss; "
                      + (f"the newest checkpoint is step {kept[-1]}" if kept
                         else "no checkpoint kept"), file=sys.stderr)
        summary |= {"step": int(state.step), "tokens_per_s": record.get("tokens_per_s")}
        stopped = stop or int(state.step) < t.steps
        if not stopped:
            final = evaluations(state, True, True)
            monitor.log({"step": t.steps, **final})
    if stopped:
        why = f"on {stop}" if stop else f"after {stop_after} steps (--stop-after)"
        summary["stopped_by"] = signals.received or ("SIGTERM" if stop else None)
        if main:
            kept = checkpoint.complete_steps(ckpt_dir)
            print(f"stopped {why} at step {int(state.step)}; "
                  + (f"checkpoint {kept[-1]} in {ckpt_dir}" if kept else "no checkpoint"))
        return summary
    summary |= {"heldout_loss": final["eval_ce"], **final}
    if main:
        print(final_line(final, run_dir))
    return summary


def final_line(final: dict, run_dir: Path) -> str:
    """A finished run's last line: its held-out loss, its tasks' accuracies, its outputs."""
    tasks = "".join(f"; {key.removeprefix('downstream/').replace('/', ' ')} {value:.3f}"
                    for key, value in final.items()
                    if key.startswith("downstream/") and key.endswith(("/acc", "/acc_norm")))
    bits = f" ({final['eval_bpb']:.3f} bits per byte)" if "eval_bpb" in final else ""
    return (f"held-out loss {final['eval_ce']:.4f}{bits}{tasks}; outputs in "
            f"{run_dir.absolute()} (metrics.jsonl, config.yaml, checkpoints/)")


def measured(cfg: Config, steps, peak: Peak | None, times: dict, data: dict) -> dict:
    """What a logged step says beside its metrics: tokens/s, model FLOP/s and MFU,
    memory, the step-time split, the data position."""
    record = {"tokens_per_s": cfg.train.batch_size * cfg.train.seq_len / times["step_time_s"]}
    record |= throughput(flops_per_token(cfg), record["tokens_per_s"], steps.mesh.size, peak,
                         fp8=cfg.moe.expert_precision == "mxfp8")
    return record | memory() | times | {f"data_{k}": v for k, v in data.items()}


def _start(cfg: Config, corpus: Corpus, steps, tokenizer, init_weights: dict | None,
           accept_new_data: bool, ckpt_dir: Path, main: bool) -> tuple:
    """(state, data position, step): restored from the latest checkpoint that reads back,
    or made from the seed (and `init_weights`); the run's config and tokenizer written
    beside its checkpoints, damaged ones set aside."""
    t, run_dir = cfg.train, Path(cfg.train.run_dir)
    saved = checkpoint.complete_steps(ckpt_dir)
    distributed.check_same(saved[-1] if saved else -1, f"the latest checkpoint step in {ckpt_dir} "
                           "(-1: none); the run directory must be shared by all processes")
    damaged = []
    if main and cfg.optimizer.name == "muon":
        print(describe(abstract_model(cfg)[1], cfg.optimizer.adamw_params), flush=True)
    if main:  # the first run of each program compiles it: tens of seconds of silence
        print(f"compiling{' and restoring from ' + str(ckpt_dir) if saved else ''} ...",
              flush=True)
    if saved:
        state, data_state, _, damaged = checkpoint.resume(
            ckpt_dir, steps, fall_back=cfg.checkpoint.skip_damaged, agree=distributed.any_process)
        start = int(state.step)
        check_same_data(data_state, corpus, ckpt_dir / str(start), accept_new_data)
        resumed = checkpoint.saved_config(checkpoint.read_meta(ckpt_dir, start)[1])
        if main and resumed.train.steps != t.steps:
            print(schedule_note(resumed, cfg, start), file=sys.stderr)
    else:
        state, data_state, start = steps.init(jax.random.PRNGKey(t.seed)), {"step": 0}, 0
        if init_weights is not None:
            state = with_weights(steps, state, init_weights)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        tokenizer.save(run_dir / RUN_SUBDIR)
        for step, why in damaged:  # out of the way of this run's saves, never deleted
            print(f"set aside damaged checkpoint {ckpt_dir / str(step)} as "
                  f"{checkpoint.set_aside(ckpt_dir, step).name}", file=sys.stderr)
    return state, data_state, start


def profile_override(span: str | None) -> list[str]:
    """--profile START:STOP as a config override."""
    if span is None:
        return []
    parts = span.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"--profile: expected START:STOP step numbers, e.g. 10:12, got {span!r}")
    return [f"logging.profile_steps=[{parts[0]}, {parts[1]}]"]


def build_parser() -> argparse.ArgumentParser:
    """The arguments of `python -m jaxmoe.train`; docs/reference/commands.md is generated from
    them."""
    parser = argparse.ArgumentParser(prog="python -m jaxmoe.train", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set moe.num_experts=32")
    parser.add_argument("--resume", action="store_true",
                        help="require a checkpoint in the run directory to resume from")
    parser.add_argument("--stop-after", type=int, default=None, metavar="N",
                        help="leave after N steps of this process, with a checkpoint")
    parser.add_argument("--init-from-hf", default=None, metavar="DIR",
                        help="start from a Hugging Face checkpoint (Qwen3-MoE, OLMoE, Mixtral, "
                             "dots1, GLM-4.5, DeepSeek-V3, Kimi-K2): its architecture replaces "
                             "the config's model shapes")
    parser.add_argument("--profile", default=None, metavar="START:STOP",
                        help="write a jax.profiler trace of train steps START..STOP to "
                             "RUN_DIR/profile (logging.profile_steps)")
    parser.add_argument("--accept-new-data", action="store_true",
                        help="resume although the data differ from the checkpoint's")
    distributed.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's routine notices
    try:
        distributed.initialize(distributed.settings(args))
        cfg = load_config(args.config, args.set + profile_override(args.profile))
        weights = None
        if args.init_from_hf:
            cfg = hf.with_architecture(cfg, hf.read_config(args.init_from_hf)[1])
        corpus = load_corpus(cfg.data.source, cfg.data.path, cfg.model.vocab_size,
                             cfg.train.seq_len, cfg.data.heldout_fraction, cfg.data.token_dtype,
                             cfg.data.weights, cfg.data.bad_text)
        make_mesh(cfg.mesh)  # device-count errors before anything compiles
        sinks.check_available(cfg)
        check_resumable(cfg, args.resume)
        if args.init_from_hf:
            if checkpoint.complete_steps(checkpoint.checkpoint_dir(cfg.train.run_dir)):
                print(f"resuming: the weights of --init-from-hf {args.init_from_hf} are not read",
                      file=sys.stderr)
            else:
                weights, _ = hf.load_hf(args.init_from_hf)
        summary = train(cfg, corpus, stop_after=args.stop_after, init_weights=weights,
                        accept_new_data=args.accept_new_data)
    except (DistributedError, ConfigError, DataError, TokenizerError, CheckpointError,
            TooManyBadSteps, Overflow, hf.HFError, RunDirectoryInUse) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception:
        distributed.failed()  # a collective broken by a lost peer: its one line, not this
        raise
    finally:
        distributed.finished()
    # stopped by a signal (here or on another process): 128 + its number, as a shell
    # reports a process the signal killed, so that `train && export` stops there
    if summary.get("stopped_by") is not None:
        return 128 + getattr(signal, summary["stopped_by"], signal.SIGTERM)
    return 0


def leave(code: int) -> None:
    """Exits with `code`. After a failure, past any thread still waiting that is not a
    daemon: a failed save leaves orbax's writer threads blocked, and interpreter
    shutdown would join them forever (the process printed its error and never exited)."""
    stuck = [t for t in threading.enumerate()
             if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if code and stuck:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    leave(main())
