"""Downstream evaluations inside training: lm-eval tasks scored on the live parameters.

`train.evals.tasks` come from the definitions `python -m jaxmoe.eval` reads
(jaxmoe's own, lm-eval's, YAMLs under `train.evals.include_path`), loaded once
before anything compiles: an unknown or malformed task, or one that generates
text, stops the run there, naming it. Every `train.evals.every` steps (by default
with the held-out loss), and at the start and the end, each task's first
`train.evals.limit` examples are scored on the parameters as they are, with no
checkpoint written or read, through the training program's dropless forward
(`Steps.score_step`), one compiled shape for all tasks: rows of the shortest
length that holds their longest request, as many as keep the dropless expert
buffers the size of a training step's (`scoring_rows`). The metrics are lm-eval's
own (its per-example results and aggregation): `downstream/<task>/<metric>` (acc,
acc_norm, ..., and their standard errors) in metrics.jsonl and the sinks.
"""

from __future__ import annotations

import math

from jaxmoe.config import Config, ConfigError
from jaxmoe.eval.harness import (EvalError, JaxmoeLM, Scorer, encode_request, import_lm_eval,
                                 load_tasks, quiet, request_row, row_lengths, set_fewshot)
from jaxmoe.data.tokenizer import Tokenizer
from jaxmoe.parallel.sharding import axis_size

PREFIX = "downstream"
STDERR_DRAWS = 100  # bootstrap draws for metrics with no closed-form standard error


class Downstream:
    """The configured tasks, ready to run on a `Steps`' live parameters."""

    def __init__(self, cfg: Config, steps, tokenizer: Tokenizer):
        evals = cfg.train.evals
        try:
            self.lm_eval = import_lm_eval()
            with quiet():  # jaxmoe's stdlib task asks about this run's held-out files
                manager, tasks = load_tasks(evals.tasks, evals.include_path,
                                            {"heldout_fraction": cfg.data.heldout_fraction})
                self.tasks = manager.load(tasks)
        except EvalError as e:
            raise ConfigError(f"train.evals: {e}") from None
        generating = sorted(name for name, task in self.tasks["tasks"].items()
                            if task.get_config("output_type") == "generate_until")
        if generating:
            raise ConfigError(f"train.evals.tasks: {', '.join(generating)} generate text, which "
                              "training does not (it scores log-likelihoods); evaluate a "
                              "checkpoint with python -m jaxmoe.eval for those")
        self.num_fewshot, self.seed = evals.num_fewshot, cfg.train.seed
        self.every = evals.every or cfg.train.eval_every
        self.limit = evals.limit or None
        self.tokenizer = tokenizer
        self.prefix_id = tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id
        self.notes: list[str] = []  # what the run's log should say of the tasks
        # one compiled shape for every task: the shortest row length that holds their
        # longest request, as many rows as keep the dropless buffers a training step's size
        longest, requests = self._rows(cfg.train.seq_len)
        # (under mesh.context a row's positions split evenly over the devices)
        multiple = math.lcm(cfg.model.attention_block or 1, axis_size(steps.mesh, "context"))
        L = next(n for n in row_lengths(cfg.train.seq_len, multiple) if n >= longest)
        self.scorer = Scorer(steps, [L], scoring_rows(cfg, steps.mesh, L, requests))

    def _rows(self, seq_len: int) -> tuple[int, int]:
        """(positions the longest request's row takes, how many requests): a continuation
        must be of 1 to seq_len tokens (a context is cut to fit); a rolling
        log-likelihood takes windows of seq_len."""
        set_fewshot(self.tasks, self.num_fewshot, self.seed)
        longest, count = 1, 0
        for name, task in self.tasks["tasks"].items():
            with quiet():
                task.build_all_requests(limit=self.limit, rank=0, world_size=1)
            count += len(task.instances)
            if any(i.request_type == "loglikelihood_rolling" for i in task.instances):
                longest = seq_len
            pairs = [encode_request(self.tokenizer, self.prefix_id, *i.args)
                     for i in task.instances if i.request_type == "loglikelihood"]
            lengths = [len(cont) for _, cont in pairs]
            self._note_uneven_choices(name, task, pairs)
            if lengths and not 1 <= min(lengths) <= max(lengths) <= seq_len:
                raise ConfigError(f"train.evals.tasks: {name} asks for continuations of "
                                  f"{min(lengths)} to {max(lengths)} tokens; a row of "
                                  f"train.seq_len={seq_len} holds 1 to {seq_len}")
            # a context of only whitespace gives no ids: the prefix token, as in JaxmoeLM
            longest = max([longest] + [len(request_row(ctx or [self.prefix_id], cont,
                                                       seq_len)[0]) - 1 for ctx, cont in pairs])
        return longest, count

    def _note_uneven_choices(self, name: str, task, pairs) -> None:
        """A multiple-choice task whose choices differ in length under this tokenizer:
        `acc` compares sums of the choices' token log-likelihoods, and a choice of fewer
        tokens sums fewer terms, so `acc` favours it whatever the model knows (a task
        made of choices equal in bytes, as stdlib_word_order's reorderings are, is
        uneven under a BPE tokenizer). `acc_norm` divides by bytes: it is the one to read."""
        if task.get_config("output_type") != "multiple_choice":
            return
        per_doc: dict[int, set[int]] = {}
        for instance, (_, cont) in zip((i for i in task.instances
                                        if i.request_type == "loglikelihood"), pairs):
            per_doc.setdefault(instance.doc_id, set()).add(len(cont))
        uneven = sum(len(lengths) > 1 for lengths in per_doc.values())
        if uneven:
            self.notes.append(
                f"note: train.evals.tasks: {name}'s choices differ in token length under this "
                f"tokenizer in {uneven} of {len(per_doc)} examples; acc favours the choice of "
                f"fewer tokens, acc_norm (per byte) does not: read "
                f"{PREFIX}/{name}/acc_norm")

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def __call__(self, state) -> dict[str, float]:
        """lm-eval's metrics of every task on the state's parameters, flattened."""
        lm = JaxmoeLM(self.scorer, (state.params, state.buffers), self.tokenizer, progress=False)
        # the same few-shot examples at every evaluation (the sampler draws as it goes)
        set_fewshot(self.tasks, self.num_fewshot, self.seed)
        with quiet():
            results = self.lm_eval.evaluator.evaluate(
                lm, self.tasks, limit=self.limit, bootstrap_iters=STDERR_DRAWS,
                log_samples=False)
        return flatten(results)


def scoring_rows(cfg: Config, mesh, length: int, requests: int) -> int:
    """Rows of `length` per scoring call: a whole number per row shard, no more than
    the requests fill, and at most one training forward's tokens times K x capacity
    factor / E: a dropless expert buffer holds every token, that many times a
    training one, so the scoring program stays within the training step's memory."""
    t, moe = cfg.train, cfg.moe
    shards = mesh.shape["data"] * mesh.shape["expert"] * cfg.pipeline.stage_microbatches
    tokens = t.batch_size // t.accumulation_steps * t.seq_len
    if cfg.num_moe_layers:
        tokens *= min(1.0, moe.capacity_factor * moe.top_k / moe.num_experts)
    per_shard = min(int(tokens // (length * shards)), -(-requests // shards))
    return max(1, per_shard) * shards


def flatten(results: dict) -> dict[str, float]:
    """{"downstream/<task>/<metric>": value} of lm-eval's results; a metric under a
    filter other than its default gets the filter's name after it."""
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            if not kind or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue  # the alias, a sample count, an "N/A" standard error
            name = metric if kind == "none" else f"{metric}_{kind}"
            out[f"{PREFIX}/{task}/{name}"] = float(value)
    return out
