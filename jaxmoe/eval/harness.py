"""python -m jaxmoe.eval --checkpoint RUN --tasks T[,T...] [--include-path DIR] [--output FILE] ...

lm-evaluation-harness tasks on a jaxmoe checkpoint, with no conversion. `JaxmoeLM`
is lm-eval's `LM` over a jaxmoe model; importing this module registers it with
lm-eval as "jaxmoe" (`lm_eval.simple_evaluate(model="jaxmoe",
model_args="checkpoint=RUN")`; lm-eval's own CLI knows only its built-in models).

- `loglikelihood`, `loglikelihood_rolling`: a request is one row, context then
  continuation, cut from the left to max_length + 1 tokens (as lm-eval's `hf`
  backend cuts it). Rows run longest first, `batch_size` at a time, through one
  compiled dropless forward split over the devices present (weights replicated;
  `--set mesh.expert=8 --set moe.dispatcher=alltoall` splits the experts instead);
  a batch's rows are max_length long, or half that while its longest row fits, so
  a few shapes compile.
- `generate_until`: jaxmoe's KV-cache decoding on one device, greedy unless the
  task samples; a prompt starts after an end-of-document token, as in
  `python -m jaxmoe.generate`, and the text ends before the first stop sequence.

Text maps to ids with the run's tokenizer (RUN_DIR/tokenizer/). Tasks: lm-eval's
built-in ones (their datasets come from the Hugging Face Hub), jaxmoe's own
(`stdlib_word_order`, `stdlib_next_line`: jaxmoe/eval/tasks/), or YAMLs under
`--include-path`.
`--output` gets lm-eval's results JSON (`--log-samples`: with every request and
response). Training runs the same tasks on its live parameters (`train.evals`,
`jaxmoe.eval.downstream`).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import os
import sys
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np
from absl import logging as absl_logging
from tqdm import tqdm

from jaxmoe import checkpoint
from jaxmoe.checkpoint import CheckpointError
from jaxmoe.config import Config, ConfigError, override_config
from jaxmoe.data.tokenizer import Tokenizer, TokenizerError
from jaxmoe.parallel.sharding import from_whole

try:  # the class exists without lm-eval; using it then says what to install
    # lm-eval's own models first: its registry lists them only while it is empty
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError:
    TemplateLM, register_model = object, lambda *names: (lambda cls: cls)

TASKS_DIR = Path(__file__).parent / "tasks"  # jaxmoe's own task definitions
MIN_ROW = 16  # the shortest row length compiled
GEN_TOKENS = 256  # new tokens when a task names no max_gen_toks (lm-eval's default)


class EvalError(ValueError):
    """A task, checkpoint or option that evaluation cannot use; the message names it."""


def import_lm_eval():
    """lm-eval, or EvalError saying how to install it."""
    try:
        import lm_eval
        import lm_eval.evaluator  # noqa: F401
    except ImportError:
        raise EvalError("downstream evaluation needs lm-eval, which is not installed: "
                        "pip install -e \".[eval]\"") from None
    return lm_eval


@contextlib.contextmanager
def quiet():
    """lm-eval's notices and progress bars silenced (it logs per task and per request)."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)  # setLevel, which clears the level its children cached
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            yield
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------- tasks


def load_tasks(names, include_path=(), metadata: dict | None = None):
    """(lm-eval's TaskManager, the Tasks and Groups `names` name). Built-in tasks
    are indexed (about 20 s) only when a name is not jaxmoe's or `include_path`'s.
    EvalError names an unknown task (and the names closest to it) or a definition
    lm-eval cannot build."""
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    names = list(names)
    if not names:
        raise EvalError("tasks: none named")
    paths = [str(TASKS_DIR)]
    for p in include_path:
        if not Path(p).is_dir():
            raise EvalError(f"include path {p}: not a directory (of task YAMLs)")
        paths.append(str(Path(p).absolute()))
    manager = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    if not all(n in manager.all_tasks for n in names):
        manager = TaskManager(include_path=paths, metadata=metadata)
    built = []
    for name in names:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise EvalError(f"task {name!r}: neither an lm-eval task, nor jaxmoe's, nor one under "
                            f"the include path{hint}")
        try:
            loaded = manager.load([name])
        except Exception as e:  # whatever lm-eval's YAML loader or task class raised
            first = str(e).splitlines()[0] if str(e) else ""
            raise EvalError(f"task {name!r}: lm-eval cannot build it from its definition "
                            f"({type(e).__name__}: {first})") from None
        groups = loaded.get("groups", {})
        built += [groups[name]] if name in groups else list(loaded["tasks"].values())
    return manager, built


def set_fewshot(loaded: dict, num_fewshot: int | None, seed: int) -> None:
    """Each task's few-shot count (num_fewshot, else its own, else 0) and sampler seed,
    as `lm_eval.simple_evaluate` sets them."""
    for task in loaded["tasks"].values():
        own = task.get_config("num_fewshot")
        if num_fewshot is not None and own != 0:  # a task fixed at zero shots stays so
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif own is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seed)


# ---------------------------------------------------------------- rows


def request_row(context_ids, continuation_ids, max_length: int) -> tuple[list[int], int]:
    """(ids, first scored target) of one request: context then continuation, their last
    max_length + 1 ids (as lm-eval's `hf` backend cuts them). Target t predicts id
    t + 1, so targets first..len - 2 are the continuation's."""
    if not continuation_ids:
        raise EvalError("a request with an empty continuation: nothing to score")
    if not context_ids:
        raise EvalError("a request with no context ids: condition on the prefix token")
    if len(continuation_ids) > max_length:
        raise EvalError(f"a continuation of {len(continuation_ids)} tokens is longer than "
                        f"max_length {max_length}")
    ids = (list(context_ids) + list(continuation_ids))[-(max_length + 1):]
    return ids, len(ids) - 1 - len(continuation_ids)


def row_lengths(max_length: int, block: int = 0) -> list[int]:
    """The row lengths that compile, shortest first: max_length, halved while it
    halves evenly, stays at least MIN_ROW and a multiple of `block` (blockwise
    attention's block; with `mesh.context`, a multiple of the split too)."""
    lengths = [max_length]
    while lengths[-1] % 2 == 0 and (half := lengths[-1] // 2) >= MIN_ROW \
            and half % (block or 1) == 0:
        lengths.append(half)
    return lengths[::-1]


def pack(rows, batch: int, L: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """int32 [batch, L + 1] ids and bool [batch, L] masks of the scored targets; rows
    past len(rows) are padding, nothing of them scored."""
    tokens_BxL1 = np.full((batch, L + 1), pad, np.int32)
    mask_BxL = np.zeros((batch, L), bool)
    for r, (ids, first) in enumerate(rows):
        tokens_BxL1[r, :len(ids)] = ids
        mask_BxL[r, first:len(ids) - 1] = True
    return tokens_BxL1, mask_BxL


class Scorer:
    """A `Steps`' dropless `score_step`, for `batch` rows (default:
    `steps.cfg.train.batch_size`; a whole number per row shard) x one of `lengths`
    (default: `row_lengths` of the config's seq_len), on the weights of each call."""

    def __init__(self, steps, lengths: list[int] | None = None, batch: int | None = None):
        self.steps = steps
        self.batch = batch or steps.cfg.train.batch_size
        self.lengths = lengths or row_lengths(steps.cfg.train.seq_len,
                                              steps.cfg.model.attention_block)

    def __call__(self, weights: tuple, tokens_BxL1: np.ndarray, mask_BxL: np.ndarray):
        """(float64 logprob [B], bool greedy [B]) under `weights`, (params, buffers) as
        the steps place them (a checkpoint's, or the training state's as it is now):
        each row's summed log-probability of its masked targets, and whether every one
        of them is the model's argmax."""
        put = lambda a: from_whole(a, self.steps.batch_sharding)  # noqa: E731
        out = jax.device_get(self.steps.score_step(*weights, put(tokens_BxL1), put(mask_BxL)))
        return np.asarray(out["logprob"], np.float64), np.asarray(out["greedy"]) > 0.5


def encode_request(vocab: Tokenizer, prefix_id: int, context: str,
                   continuation: str) -> tuple[list[int], list[int]]:
    """A log-likelihood request's (context, continuation) ids, as lm-eval's causal
    backends make them: the context's trailing whitespace moves to the continuation,
    the whole text is encoded and split after the context's ids; an empty context is
    the prefix token (or the continuation's first token, where that is it)."""
    if not context:
        ids = vocab.encode_plain(continuation)
        return (ids[:1], ids[1:]) if ids and ids[0] == prefix_id else ([prefix_id], ids)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = vocab.encode(context)
    return context_ids, vocab.encode(context + continuation)[len(context_ids):]


# ---------------------------------------------------------------- the backend


@register_model("jaxmoe")
class JaxmoeLM(TemplateLM):
    """lm-eval's LM over a jaxmoe model: log-likelihoods from `scorer` (a `Scorer`) on
    `weights`; text from `decode(prompts_BxP, first_B, new_tokens, temperature) -> ids
    [B, N]`, or None where the model only scores (inside training)."""

    def __init__(self, scorer: Scorer, weights: tuple, tokenizer: Tokenizer, decode=None,
                 progress: bool = True):
        super().__init__()
        self.scorer, self.weights, self.vocab = scorer, weights, tokenizer
        self.decode, self.progress = decode, progress

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """`simple_evaluate(model="jaxmoe", model_args={"checkpoint": RUN, ...})`: the
        arguments of `from_checkpoint`; batch_size may come from lm-eval's own."""
        args = dict(arg_dict)
        size = (additional_config or {}).get("batch_size")
        if size is not None and "batch_size" not in args:
            args["batch_size"] = size
        if "checkpoint" not in args:
            raise EvalError("model_args: name the checkpoint, e.g. checkpoint=runs/tiny")
        return from_checkpoint(args.pop("checkpoint"), **args)

    @property
    def eot_token_id(self) -> int:
        return self.vocab.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.eot_token_id if self.vocab.bos_id is None else self.vocab.bos_id

    @property
    def max_length(self) -> int:
        return self.scorer.lengths[-1]

    @property
    def tokenizer_name(self) -> str:
        return self.vocab.spec

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        if add_special_tokens is False:  # lm-eval's continuation after an empty context
            return self.vocab.encode_plain(string)
        return self.vocab.encode(string)

    def tok_decode(self, ids, **kwargs) -> str:
        return self.vocab.decode(ids)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each (context, continuation) request."""
        return self._loglikelihood_tokens(
            [(req.args, *encode_request(self.vocab, self.prefix_token_id, *req.args))
             for req in requests], disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(log-likelihood, greedy) of each ((context, continuation), ids, ids)."""
        # a context of only whitespace, which lm-eval moved into the continuation, is
        # empty: it conditions on the prefix token, as an empty context does
        results = self.score([request_row(ctx or [self.prefix_token_id], cont, self.max_length)
                              for _, ctx, cont in requests], disable_tqdm)
        for (strings, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def score(self, rows, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(logprob, greedy) of each (ids, first scored target), in order: longest
        first, `batch` rows at a time, each batch at the shortest length holding it."""
        B, out = self.scorer.batch, [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        silent = disable_tqdm or not self.progress
        with tqdm(total=len(rows), desc="scoring", disable=silent) as bar:
            for start in range(0, len(order), B):
                chunk = order[start:start + B]
                L = next(n for n in self.scorer.lengths if n >= len(rows[chunk[0]][0]) - 1)
                logprob_B, greedy_B = self.scorer(self.weights, *pack(
                    [rows[i] for i in chunk], B, L, self.eot_token_id))
                for r, i in enumerate(chunk):
                    out[i] = (float(logprob_B[r]), bool(greedy_B[r]))
                bar.update(len(chunk))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, every token predicted once, in windows of
        max_length predictions (lm-eval's rolling windows, as its hf backend takes)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        rows, owner = [], []
        for n, req in enumerate(requests):
            for window in get_rolling_token_windows(self.tok_encode(req.args[0]),
                                                    self.prefix_token_id, self.max_length,
                                                    context_len=1):
                rows.append(request_row(*make_disjoint_window(window), self.max_length))
                owner.append(n)
        totals = np.zeros(len(requests))
        np.add.at(totals, owner, [logprob for logprob, _ in self.score(rows, disable_tqdm)])
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, float(total))
        return [float(t) for t in totals]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations up to the first stop sequence (`until`), of at most
        `max_gen_toks` tokens."""
        if self.decode is None:
            raise EvalError("generate_until: this model only scores log-likelihoods (in "
                            "training); generation tasks run on a checkpoint, with "
                            "python -m jaxmoe.eval")
        from jaxmoe.generate import encode_prompts

        settings = defaultdict(list)  # one compiled decode loop per setting
        for n, req in enumerate(requests):
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(until)
            temperature = float(kwargs.get("temperature", 1.0)) if kwargs.get("do_sample") else 0.0
            new = int(kwargs.get("max_gen_toks", GEN_TOKENS))
            if new >= self.max_length:
                raise EvalError(f"generate_until: max_gen_toks {new} leaves no room for a prompt "
                                f"in max_length {self.max_length}")
            settings[(until, temperature, new)].append((n, context))
        out = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="generating",
                   disable=disable_tqdm or not self.progress)
        for (until, temperature, new), items in settings.items():
            for start in range(0, len(items), self.scorer.batch):
                chunk = items[start:start + self.scorer.batch]
                prompts_BxP, first_B = encode_prompts(self.vocab, [c for _, c in chunk],
                                                      self.max_length - new)
                P = prompts_BxP.shape[1]
                pad = next((n for n in self.scorer.lengths if n >= P), P) - P  # to a length
                prompts_BxP = np.pad(prompts_BxP, ((0, 0), (pad, 0)),  # that compiles
                                     constant_values=self.eot_token_id)
                new_BxN = np.asarray(self.decode(prompts_BxP, first_B + pad, new, temperature))
                for (n, _), ids in zip(chunk, new_BxN):
                    out[n] = before_stop(self.vocab.decode(ids), until)
                    self.cache_hook.add_partial("generate_until", requests[n].args, out[n])
                bar.update(len(chunk))
        bar.close()
        return out


def before_stop(text: str, until) -> str:
    """`text` up to the first occurrence of any stop sequence."""
    ends = [text.find(s) for s in until if s and s in text]
    return text[:min(ends)] if ends else text


# ---------------------------------------------------------------- a checkpoint's model


def eval_config(saved: Config, batch_size: int, max_length: int, overrides=()) -> tuple:
    """(config, mesh) that score the checkpoint's model: weights replicated on every
    device present and rows split over them (unless `overrides` split experts or
    stages), max_length-long rows, `batch_size` of them a step rounded up to a whole
    number per row shard."""
    from jaxmoe.parallel.sharding import make_mesh

    local = ["moe.dispatcher=grouped"] if saved.num_moe_layers else []
    cfg = override_config(saved, [
        "mesh.data=-1", "mesh.expert=1", "mesh.stage=1", "mesh.context=1", "mesh.zero1=false",
        "pipeline.virtual_stages=1",
        "pipeline.stage_microbatches=1", "train.accumulation_steps=1", "train.remat=none",
        f"train.seq_len={max_length}", *local, *overrides])
    mesh = make_mesh(cfg.mesh)
    shards = mesh.shape["data"] * mesh.shape["expert"] * cfg.pipeline.stage_microbatches
    return override_config(cfg, [f"train.batch_size={-(-batch_size // shards) * shards}"]), mesh


def from_checkpoint(path: str, batch_size: int = 16, max_length: int | None = None,
                    tokenizer: str | None = None, step: int | None = None, overrides=(),
                    progress: bool = True, seed: int = 0) -> JaxmoeLM:
    """JaxmoeLM over a checkpoint (a run directory, its checkpoints/ or a step's
    directory), placed on this process's devices, with the run's tokenizer
    (`tokenizer`: another). max_length: the longest row, the run's seq_len if None."""
    import_lm_eval()
    from jaxmoe import api
    from jaxmoe.generate import generate
    from jaxmoe.step import build_steps, place_weights
    from jaxmoe.data.tokenizer import check_vocab, load_tokenizer, run_tokenizer

    try:
        batch_size, seed = int(batch_size), int(seed)
    except ValueError:
        raise EvalError(f"batch size and seed: whole numbers (rows per forward; jaxmoe takes no "
                        f"'auto'), got {batch_size!r} and {seed!r}") from None
    if batch_size < 1:
        raise EvalError(f"batch size: must be positive, got {batch_size}")
    directory, found = checkpoint.locate(path)
    weights, saved, found, _ = checkpoint.load_weights(directory,
                                                       found if step is None else int(step))
    vocab = load_tokenizer(tokenizer) if tokenizer else run_tokenizer(
        checkpoint.run_dir_of(path), saved)
    check_vocab(vocab, saved.model.vocab_size)
    max_length = int(max_length or saved.train.seq_len)
    block = saved.model.attention_block
    if max_length < 2 or block and max_length % block:
        raise EvalError(f"max_length {max_length}: need at least 2"
                        + (f", a multiple of model.attention_block={block}" if block else ""))
    cfg, mesh = eval_config(saved, batch_size, max_length,
                            [overrides] if isinstance(overrides, str) else list(overrides))
    steps = build_steps(cfg, mesh)
    model_order = jax.device_get(weights.to_pure_dict())
    params, buffers = place_weights(steps, model_order)
    local = api.local_config(saved)

    def decode(prompts_BxP, first_B, new, temperature):
        return generate(model_order, prompts_BxP, local, key=jax.random.key(seed),
                        max_new_tokens=new, temperature=temperature, first_B=first_B,
                        eos_id=vocab.eos_id)

    return JaxmoeLM(Scorer(steps), (params, buffers), vocab, decode, progress)


def build_parser() -> argparse.ArgumentParser:
    """The arguments of `python -m jaxmoe.eval`; docs/reference/commands.md is generated from
    them."""
    parser = argparse.ArgumentParser(prog="python -m jaxmoe.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a run directory, its checkpoints/ directory, or one step's directory")
    parser.add_argument("--tasks", required=True, help="task names, comma-separated")
    parser.add_argument("--include-path", action="append", default=[], metavar="DIR",
                        help="a directory of task YAMLs (repeat for more)")
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--limit", type=float, default=None,
                        help="examples per task (below 1: that share of them)")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per forward")
    parser.add_argument("--max-length", type=int, default=None,
                        help="the longest row, in tokens (default: the run's train.seq_len)")
    parser.add_argument("--output", default=None, help="write lm-eval's results JSON here")
    parser.add_argument("--log-samples", action="store_true",
                        help="put every request and the model's responses in the results")
    parser.add_argument("--tokenizer", default=None,
                        help="override the run's saved tokenizer (a tokenizer.json or 'bytes')")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override the config the model is scored with, e.g. "
                             "--set mesh.expert=8 --set moe.dispatcher=alltoall")
    parser.add_argument("--seed", type=int, default=0,
                        help="few-shot sampling and sampled generation")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        lm_eval = import_lm_eval()
        if args.limit is not None and args.limit <= 0:
            raise EvalError(f"--limit: must be positive, got {args.limit}")
        if args.num_fewshot is not None and args.num_fewshot < 0:
            raise EvalError(f"--num-fewshot: must be >= 0, got {args.num_fewshot}")
        if args.output and Path(args.output).is_dir():
            raise EvalError(f"--output {args.output}: a directory; name the JSON file to write")
        directory, step = checkpoint.locate(args.checkpoint)
        _, meta = checkpoint.read_meta(directory, step, weights_only=True)
        # jaxmoe's stdlib task asks about the run's own held-out files
        heldout = checkpoint.saved_config(meta).data.heldout_fraction
        names = [t.strip() for t in args.tasks.split(",") if t.strip()]
        with quiet():
            manager, tasks = load_tasks(names, args.include_path, {"heldout_fraction": heldout})
        lm = from_checkpoint(args.checkpoint, args.batch_size, args.max_length, args.tokenizer,
                             overrides=args.set, seed=args.seed)
        limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
        logging.getLogger("lm_eval").setLevel(logging.WARNING)
        results = lm_eval.simple_evaluate(
            model=lm, tasks=tasks,
            num_fewshot=args.num_fewshot, limit=limit, task_manager=manager,
            log_samples=args.log_samples, random_seed=args.seed, numpy_random_seed=args.seed,
            torch_random_seed=None, fewshot_random_seed=args.seed)
    except (EvalError, CheckpointError, ConfigError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lm_eval.utils import handle_non_serializable, make_table

    results["config"]["model_args"] = {"checkpoint": str(args.checkpoint)}
    print(make_table(results))  # first: the figures survive a file that cannot be written
    if args.output:
        try:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(json.dumps(results, indent=1,
                                                    default=handle_non_serializable))
        except OSError as e:
            print(f"error: --output {args.output}: {e}", file=sys.stderr)
            return 2
        print(f"lm-eval's results in {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
