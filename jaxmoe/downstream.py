"""Downstream evaluations inside training: lm-eval tasks scored on the live parameters.

`train.evals.tasks` come from the definitions `python -m jaxmoe.eval` reads
(jaxmoe's own, lm-eval's, YAMLs under `train.evals.include_path`), loaded once
before anything compiles: an unknown or malformed task, or one that generates
text, stops the run there, naming it. Every `train.evals.every` steps (by default
with the held-out loss), and at the start and the end, each task's first
`train.evals.limit` examples are scored on the parameters as they are, with no
checkpoint written or read: rows of the training batch's shape through the
training program's dropless forward (`Steps.score_step`), one compiled program
for all tasks. The metrics are lm-eval's own (its per-example results and
aggregation): `downstream/<task>/<metric>` (acc, acc_norm, ..., and their
standard errors) in metrics.jsonl and the sinks.
"""

from __future__ import annotations

from jaxmoe.config import Config, ConfigError
from jaxmoe.eval import (EvalError, JaxmoeLM, Scorer, import_lm_eval, load_tasks, quiet,
                         set_fewshot)
from jaxmoe.tokenizer import Tokenizer

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
        # one compiled shape for every task: the training batch's
        self.lm = JaxmoeLM(Scorer(steps, None, None, [cfg.train.seq_len]), tokenizer,
                           progress=False)
        self._check_lengths(cfg.train.seq_len)

    def _check_lengths(self, seq_len: int) -> None:
        """A continuation must be of 1 to seq_len tokens (a context is cut to fit)."""
        set_fewshot(self.tasks, self.num_fewshot, self.seed)
        for name, task in self.tasks["tasks"].items():
            with quiet():
                task.build_all_requests(limit=self.limit, rank=0, world_size=1)
            pairs = [i.args for i in task.instances if i.request_type == "loglikelihood"]
            lengths = [len(self.lm.tok_encode(cont)) if not ctx else
                       len(self.lm._encode_pair(ctx, cont)[1]) for ctx, cont in pairs]
            if lengths and not 1 <= min(lengths) <= max(lengths) <= seq_len:
                raise ConfigError(f"train.evals.tasks: {name} asks for continuations of "
                                  f"{min(lengths)} to {max(lengths)} tokens; a row of "
                                  f"train.seq_len={seq_len} holds 1 to {seq_len}")

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def __call__(self, state) -> dict[str, float]:
        """lm-eval's metrics of every task on the state's parameters, flattened."""
        self.lm.scorer.params, self.lm.scorer.buffers = state.params, state.buffers
        # the same few-shot examples at every evaluation (the sampler draws as it goes)
        set_fewshot(self.tasks, self.num_fewshot, self.seed)
        with quiet():
            results = self.lm_eval.evaluator.evaluate(
                self.lm, self.tasks, limit=self.limit, bootstrap_iters=STDERR_DRAWS,
                log_samples=False)
        return flatten(results)


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
