"""Downstream evaluation: lm-eval tasks through `python -m jaxmoe.eval` and through
lm-eval's own `hf` backend on the run's export agree; the backend's numbers are
`jaxmoe.apply`'s and its text `python -m jaxmoe.generate`'s; the in-loop evaluation
moves with training and equals the checkpoint's; bad tasks and checkpoints are named."""

import json
import math

import jax
import numpy as np
import pytest

import jaxmoe
from jaxmoe.config import ConfigError, config_from_dict
from jaxmoe.data.corpus import load_corpus
from jaxmoe.eval.harness import before_stop, from_checkpoint, main, request_row, row_lengths
from jaxmoe.train import train

lm_eval = pytest.importorskip("lm_eval")

L = 128  # the run's seq_len: max_length of every backend here (the stdlib lines fit)
LIMIT = 24  # in-loop examples
RUN = {  # Qwen3-MoE's architecture, so the run exports to transformers
    "model": {"d_model": 32, "num_layers": 3, "num_heads": 2, "num_kv_heads": 1,
              "num_dense_layers": 1, "mlp_hidden": 64},
    "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32, "capacity_factor": 1.0},
    "train": {"steps": 20, "batch_size": 8, "seq_len": L, "eval_every": 10, "eval_batches": 1,
              "evals": {"tasks": ["stdlib_word_order"], "limit": LIMIT}},
    "optimizer": {"warmup_steps": 2, "learning_rate": 1e-2},
    "checkpoint": {"every": 10, "keep": 2},
    "logging": {"progress": False},
}
# a multiple-choice task and a rolling log-likelihood one over a JSONL made here
DOCS = [("def add(a, b):\n    return", [" a + b", " a - b", " None"], 0),
        ("for i in range(10):\n   ", [" print(i)", " pass", " i += 1"], 0),
        ("import os\nimport", [" sys", " os.path", " 42"], 0),
        ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y",
         [" = y", " = x", "()"], 0),
        ("", ["if __name__ == '__main__':", "}}}}", "   "], 0),
        ("x" * 200 + "\nresult = [", ["1, 2, 3]", "]", "'a'"], 1)]  # cut from the left
TASKS = """
task: probe_choice
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}}]
---
task: probe_rolling
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{ctx}}}}{{{{choices[0]}}}}"
metric_list: [{{metric: word_perplexity}}, {{metric: bits_per_byte}}]
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """20 steps with the stdlib task scored in the loop; checkpoints at 10 and 20."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = config_from_dict({**RUN, "train": {**RUN["train"], "run_dir": str(run_dir)}})
    train(cfg, load_corpus("stdlib", None, 256, L))
    return run_dir


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A directory holding the probe tasks' YAMLs and their JSONL."""
    where = tmp_path_factory.mktemp("tasks")
    data = where / "docs.jsonl"
    data.write_text("".join(json.dumps({"ctx": c, "choices": ch, "gold": g}) + "\n"
                            for c, ch, g in DOCS))
    for text in TASKS.split("---"):
        name = text.split("task: ")[1].split()[0]
        (where / f"{name}.yaml").write_text(text.format(data=data))
    return where


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tolerance(tokens: int, max_abs_logit: float, cfg) -> float:
    """How far two fp32 computations of a log-likelihood over `tokens` targets may
    differ. A target's log-probability z_y - logsumexp(z) moves by at most twice the
    largest error of a logit. A logit comes through a chain of about 4 products per
    layer (q/k/v, attention, out, the MLP's two), each an fp32 sum of at most K terms
    rounded in an order of its implementation's own; rounding errors of a sum of K
    terms grow like sqrt(K) units of 2^-24 of its magnitude (a random walk; the
    worst case, K units, is never met by sums of unrelated signs), and RMSNorm
    keeps each stage's magnitude that of the logits. Both sides err: twice again;
    and a factor of 4 of slack for the softmax's exp and log."""
    m = cfg.model
    K = max(m.d_model, m.mlp_hidden, cfg.moe.expert_hidden, L, m.num_heads * m.head_size)
    chain = 4 * m.num_layers + 2  # + embedding lookup's and the head's products
    per_logit = chain * math.sqrt(K) * 2.0 ** -24 * max_abs_logit
    return tokens * 2 * 2 * 4 * per_logit


def _resps(samples):
    """Per doc, the (log-likelihood, greedy) of each request, in doc order."""
    return [[tuple(float(v) if i == 0 else str(v) == "True" for i, v in enumerate(r[0]))
             for r in s["resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])]


def test_in_loop_accuracy_moves_and_equals_the_checkpoints(run, tmp_path):
    logged = {r["step"]: r for r in _records(run) if "downstream/stdlib_word_order/acc" in r}
    assert sorted(logged) == [0, 10, 20]
    accs = [logged[s]["downstream/stdlib_word_order/acc"] for s in (0, 10, 20)]
    assert len(set(accs)) > 1, accs  # it moves with training
    for r in logged.values():
        assert 0 < r["downstream/stdlib_word_order/acc_stderr"] < 0.5
        assert np.isfinite(r["eval_ce"]) and np.isfinite(r["eval_bpb"])
    # the byte model's bits per byte are its nats per token over ln 2
    np.testing.assert_allclose(logged[20]["eval_bpb"], logged[20]["eval_ce"] / math.log(2),
                               rtol=1e-12)
    # the checkpoint of step 20 scores the same docs alike through python -m jaxmoe.eval
    out = tmp_path / "results.json"
    assert main(["--checkpoint", str(run), "--tasks", "stdlib_word_order", "--limit", str(LIMIT),
                 "--output", str(out), "--batch-size", "8"]) == 0
    results = json.loads(out.read_text())["results"]["stdlib_word_order"]
    assert results["acc,none"] == accs[-1]
    assert results["acc_norm,none"] == logged[20]["downstream/stdlib_word_order/acc_norm"]


def test_jaxmoe_eval_and_lm_evals_hf_backend_agree_on_the_export(run, tasks, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    from jaxmoe.export import main as export_main

    ours = {}
    for step in (10, 20):
        out = tmp_path / f"ours_{step}.json"
        assert main(["--checkpoint", str(run / "checkpoints" / str(step)), "--tasks",
                     "probe_choice,probe_rolling", "--include-path", str(tasks), "--log-samples",
                     "--output", str(out), "--batch-size", "4"]) == 0
        ours[step] = json.loads(out.read_text())
    assert export_main(["--checkpoint", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(tmp_path / "hf"), "dtype": "float32",
                                "max_length": L},
        tasks=["probe_choice", "probe_rolling"], batch_size=4, device="cpu", log_samples=True,
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        torch_random_seed=0)
    params, cfg = jaxmoe.load_params(run)
    rows = [request_row([0] + list(ctx.encode()), list(c.encode()), L)[0]
            for ctx, choices, _ in DOCS for c in choices]
    logits = np.concatenate([np.asarray(jaxmoe.apply(params, np.asarray(r[:-1])[None], cfg)[0])
                             for r in rows], axis=1)
    bound = max(abs(logits.min()), abs(logits.max()))

    final, hf = _resps(ours[20]["samples"]["probe_choice"]), _resps(theirs["samples"]["probe_choice"])
    earlier = _resps(ours[10]["samples"]["probe_choice"])
    differs = 0
    for (ctx, choices, _), a, b, c in zip(DOCS, final, hf, earlier):
        for choice, (ll_a, greedy_a), (ll_b, greedy_b), (ll_c, _) in zip(choices, a, b, c):
            tol = _tolerance(len(choice.encode()), bound, cfg)
            assert abs(ll_a - ll_b) <= tol, (ctx, choice, ll_a, ll_b, tol)
            assert greedy_a == greedy_b
            differs += abs(ll_a - ll_c) > tol  # another checkpoint is told apart
    assert differs == sum(len(ch) for _, ch, _ in DOCS)
    assert ours[20]["results"]["probe_choice"]["acc,none"] == \
        theirs["results"]["probe_choice"]["acc,none"]
    for a, b in zip(_rolling(ours[20]), _rolling(theirs)):
        np.testing.assert_allclose(a, b, atol=_tolerance(120, bound, cfg), rtol=0)


def _rolling(results):
    return [float(s["resps"][0][0]) for s in sorted(results["samples"]["probe_rolling"],
                                                    key=lambda s: s["doc_id"])]


class _Request:
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def lm(run):
    return from_checkpoint(str(run), batch_size=4, progress=False)


def test_loglikelihoods_are_apply_s(run, lm):
    params, cfg = jaxmoe.load_params(run)

    def direct(ids, first):
        """(log-likelihood of targets first.., all greedy, tolerance) from apply's logits."""
        logits = np.asarray(jaxmoe.apply(params, np.asarray(ids[:-1])[None], cfg)[0][0],
                            np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        targets = np.asarray(ids[1:])
        picked = logp[np.arange(len(targets)), targets][first:]
        greedy = bool(np.all(logits.argmax(-1)[first:] == targets[first:]))
        return picked.sum(), greedy, _tolerance(len(picked), np.abs(logits).max(), cfg)

    long = "def f(x):\n    return x * 2\n" * 10 + "y = f(3)"  # cut from the left to fit
    # contexts end in no whitespace, which lm-eval would move into the continuation
    requests = [("def f(x):\n    return", " x"), ("import", " os"), ("", "print('hi')"),
                (long, "\n"), ("\n  ", "pass")]  # the last context is all whitespace
    got = lm.loglikelihood([_Request(c, x) for c, x in requests], disable_tqdm=True)
    for (context, continuation), (ll, greedy) in zip(requests, got):
        # lm-eval moves a context's trailing whitespace into the continuation; nothing
        # left conditions on the prefix token, as an empty context does
        stripped = context.rstrip()
        continuation = context[len(stripped):] + continuation
        ctx = list(stripped.encode()) or [lm.prefix_token_id]
        ids, first = request_row(ctx, list(continuation.encode()), L)
        want, want_greedy, tol = direct(ids, first)
        assert abs(ll - want) <= tol and greedy == want_greedy, (context, ll, want)
        if context:  # the context counts: the continuation alone scores otherwise
            alone, _, _ = direct([lm.prefix_token_id] + list(continuation.encode()), 1)
            assert abs(alone - want) > tol
    # rolling: each token predicted once, windows of max_length predictions after EOS
    text = long + "end"
    (rolled,) = lm.loglikelihood_rolling([_Request(text)], disable_tqdm=True)
    ids = list(text.encode())
    total, tol, done = 0.0, 0.0, 0
    while done < len(ids):
        end = min(done + L, len(ids))
        window = ([lm.prefix_token_id] + ids)[max(0, end - L):end + 1]
        ll, _, window_tol = direct(window, len(window) - 1 - (end - done))
        total, tol, done = total + ll, tol + window_tol, end
    assert done > L and abs(rolled - total) <= tol  # several windows


def test_generate_until_is_python_m_jaxmoe_generate_s(run, lm, capsys):
    from jaxmoe.generate import main as generate_main

    prompts = ["def f(x):\n    ", "import", "class A:\n"]
    got = lm.generate_until([_Request(p, {"until": ["\n\n", "):"], "max_gen_toks": 12})
                             for p in prompts], disable_tqdm=True)
    for prompt, text in zip(prompts, got):
        assert generate_main(["--checkpoint", str(run), "--prompt", prompt, "--temperature", "0",
                              "--max-new-tokens", "12"]) == 0
        printed = capsys.readouterr().out
        assert printed.startswith(prompt)
        whole = printed[len(prompt):].removesuffix("\n")
        assert text == before_stop(whole, ["\n\n", "):"])
    # stop sequences cut where they first occur
    assert before_stop("ab):cd\n\nx", ["\n\n", "):"]) == "ab" and before_stop("abc", ["x"]) == "abc"


def test_rows_that_compile():
    assert row_lengths(128) == [16, 32, 64, 128]
    assert row_lengths(96, block=32) == [96]  # 48 is no multiple of the attention block
    assert row_lengths(24) == [24]  # 12 is too short to be worth a program


def _error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_tasks_and_checkpoints_are_named(run, tasks, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "broken.yaml").write_text("task: broken\noutput_type: no_such_type\n"
                                        "dataset_path: json\n")
    assert "task 'broken'" in _error(capsys, "--checkpoint", str(run), "--tasks", "broken",
                                     "--include-path", str(broken))
    message = _error(capsys, "--checkpoint", str(run), "--tasks", "probe_choise",
                     "--include-path", str(tasks))
    assert "'probe_choise'" in message and "probe_choice" in message  # the near name
    # a run on raw token shards with data.tokenizer: bytes holds no tokenizer for its ids
    shards = tmp_path / "shards.bin"
    np.random.default_rng(0).integers(0, 300, 20_000).astype(np.uint16).tofile(shards)
    cfg = config_from_dict({**RUN, "model": {**RUN["model"], "vocab_size": 300},
                            "data": {"source": "tokens", "path": str(shards)},
                            "train": {**RUN["train"], "steps": 1, "evals": {},
                                      "run_dir": str(tmp_path / "ids")},
                            "optimizer": {"warmup_steps": 0}})
    train(cfg, load_corpus("tokens", str(shards), 300, L))
    assert "--tokenizer" in _error(capsys, "--checkpoint", str(tmp_path / "ids"), "--tasks",
                                   "probe_choice", "--include-path", str(tasks))
    # its held-out loss has no bytes to count bits over; it exports without a tokenizer
    last = _records(tmp_path / "ids")[-1]
    assert "eval_ce" in last and "eval_bpb" not in last
    from jaxmoe.export import main as export_main
    assert export_main(["--checkpoint", str(tmp_path / "ids"), "--format", "hf",
                        "--out", str(tmp_path / "ids_hf")]) == 0
    assert "no tokenizer written" in capsys.readouterr().err
    assert not (tmp_path / "ids_hf" / "tokenizer.json").exists()
    (tmp_path / "out").mkdir()
    assert "a directory" in _error(capsys, "--checkpoint", str(run), "--tasks", "probe_choice",
                                   "--output", str(tmp_path / "out"))
    assert "--num-fewshot" in _error(capsys, "--checkpoint", str(run), "--tasks",
                                     "probe_choice", "--num-fewshot", "-1")
    assert "no complete checkpoint" in _error(capsys, "--checkpoint", str(tmp_path), "--tasks",
                                              "probe_choice")


def test_training_refuses_tasks_it_cannot_run(tasks, tmp_path):
    from jaxmoe.eval.downstream import Downstream
    from jaxmoe.parallel.sharding import make_mesh
    from jaxmoe.step import build_steps
    from jaxmoe.data.tokenizer import BYTE_TOKENIZER

    (tmp_path / "gen.yaml").write_text((tasks / "probe_choice.yaml").read_text().replace(
        "probe_choice", "gen").replace("multiple_choice", "generate_until"))
    (tmp_path / "broken.yaml").write_text("task: broken\noutput_type: no_such_type\n")
    for names, message in ((["gen"], "generate text"), (["broken"], "'broken'")):
        cfg = config_from_dict({**RUN, "train": {**RUN["train"], "evals": {
            "tasks": names, "include_path": [str(tmp_path), str(tasks)]}}})
        with pytest.raises(ConfigError, match="train.evals") as e:
            Downstream(cfg, build_steps(cfg, make_mesh(cfg.mesh)), BYTE_TOKENIZER)
        assert message in str(e.value)
    jax.clear_caches()


def test_in_loop_few_shot_examples_stay_the_same(tasks):
    """The few-shot sampler is reseeded at every evaluation: the same prompts (and so
    the same figures) each time, not a new draw per evaluation."""
    from jaxmoe.eval.downstream import Downstream
    from jaxmoe.parallel.sharding import make_mesh
    from jaxmoe.step import build_steps
    from jaxmoe.data.tokenizer import BYTE_TOKENIZER

    cfg = config_from_dict({**RUN, "train": {**RUN["train"], "evals": {
        "tasks": ["probe_choice"], "include_path": [str(tasks)], "num_fewshot": 2}}})
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    state = steps.init(jax.random.PRNGKey(0))
    downstream = Downstream(cfg, steps, BYTE_TOKENIZER)
    task = downstream.tasks["tasks"]["probe_choice"]
    prompts, results = [], []
    for _ in range(2):
        results.append(downstream(state))
        prompts.append([i.args[0] for i in task.instances])
    assert prompts[0] == prompts[1] and results[0] == results[1]
    assert all(p.count("\n") >= 2 for p in prompts[0])  # two examples before each question


def test_choices_uneven_in_tokens_are_noted(tmp_path):
    """stdlib_word_order's choices are reorderings of one line's words: equal in bytes,
    so byte tokens make them equal in length, and a BPE tokenizer does not (a real
    line's common pairs merge into fewer tokens), where `acc` favours the shorter:
    the run's log says so and points at acc_norm. Companion: bytes give no note."""
    from jaxmoe.data.tokenizer import BYTE_TOKENIZER, load_tokenizer
    from jaxmoe.eval.downstream import Downstream
    from jaxmoe.parallel.sharding import make_mesh
    from jaxmoe.step import build_steps

    from tiny_tokenizer import make_tokenizer

    cfg = config_from_dict({**RUN, "model": {**RUN["model"], "vocab_size": 320},
                            "train": {**RUN["train"], "evals": {"tasks": ["stdlib_word_order"],
                                                                "limit": LIMIT}}})
    steps = build_steps(cfg, make_mesh(cfg.mesh))
    bpe = load_tokenizer(str(make_tokenizer(tmp_path)))
    (note,) = Downstream(cfg, steps, bpe).notes
    assert note.startswith("note: train.evals.tasks: stdlib_word_order's choices differ in "
                           "token length under this tokenizer in ")
    assert note.endswith("read downstream/stdlib_word_order/acc_norm")
    assert Downstream(cfg, steps, BYTE_TOKENIZER).notes == []
    jax.clear_caches()
