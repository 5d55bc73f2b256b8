"""python -m jaxmoe.data.prepare: documents -> token shards with one EOS each, an index, a
held-out split by document, uint16/uint32 by vocabulary, resumable after a crash."""

import json
import os

import numpy as np
import pytest

from jaxmoe.data import prepare as prep
from jaxmoe.data.corpus import DataError, load_corpus
from jaxmoe.data.prepare import PrepareError, is_heldout, main, prepare
from jaxmoe.data.tokenizer import load_tokenizer
from tiny_tokenizer import make_tokenizer, sentences


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """12 text files, a 60-line JSON Lines file, and a saved 50-row dataset."""
    root = tmp_path_factory.mktemp("inputs")
    texts = sentences(122, seed=1)
    (root / "txt").mkdir()
    for i, t in enumerate(texts[:12]):
        (root / "txt" / f"{i:02d}.txt").write_text(t)
    with open(root / "docs.jsonl", "w") as f:
        for t in texts[12:72]:
            f.write(json.dumps({"body": t, "id": 0}) + "\n")
    import datasets
    datasets.Dataset.from_dict({"body": texts[72:]}).save_to_disk(str(root / "ds"))
    return root, texts


def _split_docs(tokens, eos):
    """The id lists between EOS tokens (each document must end with one)."""
    assert tokens[-1] == eos
    ends = np.flatnonzero(tokens == eos)
    return [list(tokens[a + 1:b]) for a, b in zip(np.concatenate([[-1], ends[:-1]]), ends)]


def _read_split(out, index, split):
    return [np.fromfile(out / s["file"], index["dtype"]) for s in index["shards"]
            if s["split"] == split]


def test_every_input_kind_with_one_eos_per_document(tmp_path, tok_dir, inputs):
    root, texts = inputs
    out = tmp_path / "out"
    index = prepare([str(root / "txt"), str(root / "docs.jsonl"), str(root / "ds")], out,
                    str(tok_dir), text_field="body", heldout_fraction=0.2, workers=2,
                    unit_mb=200 / 2**20, progress=False)
    tok = load_tokenizer(tok_dir)
    assert index["dtype"] == "uint16" and index["tokenizer"]["sha256"] == tok.sha256
    assert len({s["file"] for s in index["shards"]}) > 4  # several units, in parallel workers
    docs = {split: [d for shard in _read_split(out, index, split)
                    for d in _split_docs(shard, tok.eos_id)] for split in ("train", "val")}
    want = {"train": [], "val": []}
    for t in texts:
        want["val" if is_heldout(t, 0.2) else "train"].append(tok.encode(t))
    assert 0 < len(want["val"]) < len(want["train"])
    for split in ("train", "val"):
        assert sorted(docs[split]) == sorted(want[split])  # same documents, same split
        assert index["totals"][split] == {"documents": len(want[split]),
                                          "tokens": sum(len(d) + 1 for d in want[split])}
    for s in index["shards"]:
        tokens = np.fromfile(out / s["file"], index["dtype"])
        assert s["tokens"] == len(tokens) and (s["max_id"] == tokens.max() if len(tokens) else 1)
        assert s["documents"] == int((tokens == tok.eos_id).sum())
    corpus = load_corpus("tokens", str(out), 300, 8)  # what the loader reads
    assert sum(s.tokens for s in corpus.train) == index["totals"]["train"]["tokens"]
    assert corpus.tokenizer["sha256"] == tok.sha256


def test_dtype_follows_the_vocabulary(tmp_path, inputs):
    from tokenizers import Tokenizer, models, pre_tokenizers
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000},
                                     unk_token="w0"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "big").mkdir()
    big.save(str(tmp_path / "big" / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("w69999 w5 w70")
    index = prepare([str(tmp_path / "doc.txt")], tmp_path / "out", str(tmp_path / "big"),
                    heldout_fraction=0.0, workers=1, progress=False)
    assert index["dtype"] == "uint32"
    tokens = np.fromfile(tmp_path / "out" / index["shards"][0]["file"], "<u4")
    np.testing.assert_array_equal(tokens, [69_999, 5, 70, 70_000])


def test_a_crash_mid_shard_leaves_nothing_that_reads_as_complete(tmp_path, tok_dir, inputs,
                                                                  monkeypatch):
    root, _ = inputs
    args = ([str(root / "txt")], tmp_path / "out", str(tok_dir))
    kw = dict(heldout_fraction=0.2, workers=1, unit_mb=100 / 2**20, progress=False)
    clean = prepare(*args[:1], tmp_path / "clean", *args[2:], **kw)

    writes = []
    real_write = prep._write

    def crash_on_fifth(path, tokens):
        writes.append(path)
        if len(writes) == 5:  # half of this shard reaches the disk, then the process dies
            with open(path.with_name(path.name + prep.PARTIAL), "wb") as f:
                tokens[:len(tokens) // 2].tofile(f)
            raise KeyboardInterrupt
        real_write(path, tokens)

    monkeypatch.setattr(prep, "_write", crash_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        prepare(*args, **kw)
    out = tmp_path / "out"
    assert not (out / "index.json").exists() and list(out.glob("*.partial"))
    with pytest.raises(DataError, match="has no index.json: make it with python -m jaxmoe.data.prepare"):
        load_corpus("tokens", str(out), 300, 4)
    # a glob over the shards finds only complete ones: two whole units' shards
    names = sorted(p.name for p in out.glob("*.bin"))
    assert names == ["train-00000.bin", "train-00001.bin", "val-00000.bin", "val-00001.bin"]
    for n in names:
        assert (out / n).read_bytes() == (tmp_path / "clean" / n).read_bytes()

    monkeypatch.setattr(prep, "_write", real_write)
    done = []
    real_unit = prep.tokenize_unit
    monkeypatch.setattr(prep, "tokenize_unit", lambda *a, **k: done.append(a[1]) or real_unit(*a, **k))
    resumed = prepare(*args, **kw)
    assert done and min(done) == 2  # units 0 and 1 were kept
    assert resumed["shards"] == clean["shards"]
    assert not list(out.glob("*.partial"))
    for s in clean["shards"]:
        assert (out / s["file"]).read_bytes() == (tmp_path / "clean" / s["file"]).read_bytes()
    done.clear()
    assert prepare(*args, **kw) == resumed and not done  # complete: nothing to do
    (out / "train-notes.json").write_text("the user's")  # not a name prepare writes
    with pytest.raises(PrepareError, match=r"holds a finished preparation of other inputs or "
                                           r"options \(--heldout-fraction was 0.2, now 0.3\); "
                                           r"it is kept: pass --rebuild"):
        prepare(*args, **{**kw, "heldout_fraction": 0.3})
    assert prepare(*args, **kw) == resumed and not done  # kept whole
    changed = prepare(*args, **{**kw, "heldout_fraction": 0.3}, rebuild=True)  # starts clean
    units = len(list((tmp_path / "clean").glob("unit-*.json")))
    assert changed["heldout_fraction"] == 0.3 and sorted(done) == list(range(units))
    assert (out / "train-notes.json").read_text() == "the user's"


def test_bad_inputs_are_refused_by_name(tmp_path, tok_dir, inputs):
    root, _ = inputs
    with pytest.raises(PrepareError, match="nope.txt does not exist"):
        prepare([str(tmp_path / "nope.txt")], tmp_path / "o1", str(tok_dir), progress=False)
    with pytest.raises(PrepareError, match=r"docs.jsonl \(byte 0\): no string field 'text'"):
        prepare([str(root / "docs.jsonl")], tmp_path / "o2", str(tok_dir), workers=1,
                progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(PrepareError, match=r"bad.jsonl \(byte 14\): not a JSON line"):
        prepare([str(tmp_path / "bad.jsonl")], tmp_path / "o3", str(tok_dir), workers=1,
                progress=False)
    with pytest.raises(PrepareError, match="no column 'text'.*--text-field"):
        prepare([str(root / "ds")], tmp_path / "o4", str(tok_dir), progress=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(PrepareError, match="mine is not empty and was not made by jaxmoe.data.prepare"):
        prepare([str(root / "txt")], tmp_path / "mine", str(tok_dir), progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    import datasets
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(PrepareError, match=r"is a DatasetDict; name one split's directory"):
        prepare([str(tmp_path / "dd")], tmp_path / "o5", str(tok_dir), progress=False)


def test_gzip_and_bad_utf8_json_lines(tmp_path, tok_dir):
    import gzip
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "the dog"}) + "\n" + json.dumps({"text": "a cat"}) + "\n")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "sun"}\n{"text": "caf\xe9 sun"}\n')  # Latin-1
    args = ([str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.jsonl")], str(tok_dir))
    kw = dict(heldout_fraction=0.0, workers=1, progress=False)
    with pytest.raises(PrepareError, match=r"b.jsonl: byte 29 \(0xe9\) is not UTF-8; convert it "
                                           r"to UTF-8, or set --bad-text replace .* or skip"):
        prepare(args[0], tmp_path / "o1", args[1], **kw)
    tok = load_tokenizer(tok_dir)
    for bad_text, last, count in (("replace", ["caf\ufffd sun"], "replaced 1 non-UTF-8 byte"),
                                  ("skip", [], "skipped 1: 1 not UTF-8")):
        index = prepare(args[0], tmp_path / bad_text, args[1], bad_text=bad_text, **kw)
        tokens = np.concatenate(_read_split(tmp_path / bad_text, index, "train"))
        docs = [tok.decode(d) for d in _split_docs(tokens, tok.eos_id)]
        assert docs == ["the dog", "a cat", "sun"] + last
        assert count in prep.describe_counts(index["counts"], "documents")
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n{"text": 1}\n'))
    with pytest.raises(PrepareError, match=r"c.jsonl.gz \(line 2\): no string field 'text'"):
        prepare([str(tmp_path / "c.jsonl.gz")], tmp_path / "o", str(tok_dir), workers=1,
                progress=False)
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n{"text": "\xff"}\n'))
    with pytest.raises(PrepareError, match=r"d.jsonl.gz \(line 2, uncompressed\): byte 24 "
                                           r"\(0xff\) is not UTF-8"):
        prepare([str(tmp_path / "d.jsonl.gz")], tmp_path / "o", str(tok_dir), workers=1,
                progress=False)


def _snapshot(directory):
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir())}


def test_a_finished_preparation_is_kept_unless_rebuild_says(tmp_path, tok_dir, inputs,
                                                           monkeypatch, capsys):
    root, _ = inputs
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in sorted((root / "txt").iterdir())[:6]:
        (corpus / f.name).write_bytes(f.read_bytes())
    out, kw = tmp_path / "out", dict(heldout_fraction=0.2, workers=1, progress=False)
    index = prepare([str(corpus)], out, str(tok_dir), **kw)
    before = _snapshot(out)
    read = []
    real_problem = prep.text_problem
    monkeypatch.setattr(prep, "text_problem", lambda raw: read.append(raw) or real_problem(raw))
    monkeypatch.setattr(prep, "tokenize_unit", lambda *a, **k: pytest.fail("tokenized again"))

    os.utime(corpus / "02.txt", ns=(1, 1))  # touched (cp without -a): the same content
    assert prepare([str(corpus)], out, str(tok_dir), **kw) == index
    assert len(read) == 1  # only the touched file is hashed again ...
    read.clear()
    assert prepare([str(corpus)], out, str(tok_dir), **kw) == index
    assert not read  # ... and its new mtime was recorded
    kept = _snapshot(out)
    assert {k: v for k, v in kept.items() if k != "prepare.json"} == \
        {k: v for k, v in before.items() if k != "prepare.json"}

    text = (corpus / "03.txt").read_text()
    (corpus / "03.txt").write_text(text.swapcase())  # the same size and a new content
    (corpus / "new.md").write_text("A new document.")
    for inputs_, said in (([str(corpus)], r"1 file changed: \S+03.txt; 1 file added: \S+new.md"),
                          ([str(corpus / "00.txt")], r"5 files removed: \S+01.txt, \S+02.txt and "
                                                     r"3 more")):
        with pytest.raises(PrepareError, match=rf"holds a finished preparation of other inputs or "
                                               rf"options \({said}\); it is kept: pass --rebuild"):
            prepare(inputs_, out, str(tok_dir), **kw)
        assert _snapshot(out) == kept  # not a byte of it touched
    capsys.readouterr()
    argv = [str(corpus), "--out", str(out), "--tokenizer", str(tok_dir), "--no-progress",
            "--workers", "1", "--heldout-fraction", "0.2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out") and "03.txt" in err[0]
    assert _snapshot(out) == kept

    monkeypatch.undo()
    assert main(argv + ["--rebuild"]) == 0
    assert json.loads((out / "index.json").read_text())["counts"]["read"] == 7


def test_bad_text_is_refused_skipped_or_replaced_and_counted(tmp_path, tok_dir, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("The quick brown fox.")
    (corpus / "b-empty.txt").write_text("")
    (corpus / "c-blank.md").write_text(" \n\n")
    (corpus / "d-latin1.txt").write_bytes("caf\u00e9 sun".encode("latin-1"))
    (corpus / "e-binary.txt").write_bytes(b"PK\x03\x04\x00\x01")
    (corpus / "notes.csv").write_text("a,b")
    (corpus / "f.bin").write_bytes(b"\x01")
    kw = dict(heldout_fraction=0.0, workers=1, progress=False)
    with pytest.raises(PrepareError, match=r"d-latin1.txt: byte 3 \(0xe9\) is not UTF-8; convert "
                                           r"it to UTF-8, or set --bad-text replace .*or skip "
                                           r"\(1 more binary or non-UTF-8 file\)"):
        prepare([str(corpus)], tmp_path / "refused", str(tok_dir), **kw)
    assert not (tmp_path / "refused").exists()  # refused before anything is written
    with pytest.raises(PrepareError, match=r"e-binary.txt: byte 4 is NUL: a binary file, not "
                                           r"text; remove it, or set --bad-text skip"):
        prepare([str(corpus)], tmp_path / "replaced", str(tok_dir), bad_text="replace", **kw)

    capsys.readouterr()
    assert main([str(corpus), "--out", str(tmp_path / "skipped"), "--tokenizer", str(tok_dir),
                 "--bad-text", "skip", "--workers", "1", "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "inputs: read 1 document; skipped 6: 2 files by suffix (.bin 1, .csv 1), 2 empty, "
        "1 binary, 1 not UTF-8")
    (corpus / "e-binary.txt").unlink()
    index = prepare([str(corpus)], tmp_path / "replaced", str(tok_dir), bad_text="replace", **kw)
    assert prep.describe_counts(index["counts"], "documents") == (
        "read 2 documents; skipped 4: 2 files by suffix (.bin 1, .csv 1), 2 empty; replaced 1 "
        "non-UTF-8 byte with U+FFFD in 1 document")
    tok = load_tokenizer(tok_dir)
    tokens = np.concatenate(_read_split(tmp_path / "replaced", index, "train"))
    assert [tok.decode(d) for d in _split_docs(tokens, tok.eos_id)] == [
        "The quick brown fox.", "caf\ufffd sun"]


def test_empty_documents_never_make_the_heldout_split(tmp_path, tok_dir):
    """The hash of "" is 0: an empty document used to be held out at any fraction."""
    (tmp_path / "a.txt").write_text(" ".join(sentences(40, seed=4)))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "rows.jsonl").write_text('{"text": ""}\n{"text": "  "}\n{"text": "A cat."}\n')
    out = tmp_path / "out"
    index = prepare([str(tmp_path / "a.txt"), str(tmp_path / "empty.txt"),
                     str(tmp_path / "rows.jsonl")], out, str(tok_dir), workers=1, progress=False)
    assert index["totals"]["val"]["documents"] == 0 and index["counts"]["skipped empty"] == 3
    corpus = load_corpus("tokens", str(out), 300, 8)  # held out: the tail of each shard
    assert max(len(h) for h in corpus.heldout) > 8


def test_a_small_heldout_split_names_its_cause(tmp_path, tok_dir):
    texts = sentences(300, seed=5)
    held = [t for t in texts if is_heldout(t, 0.05)][:1]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                                 [t for t in texts if not is_heldout(t, 0.05)]
                                                 + held))
    index = prepare([str(tmp_path / "docs.jsonl")], tmp_path / "out", str(tok_dir), workers=1,
                    progress=False)
    n = index["totals"]["val"]["tokens"]
    with pytest.raises(DataError, match=rf"has {n} heldout tokens; need at least seq_len\+1 = 65 "
                                        rf"in one shard, the largest has {n} \(held out: 1 "
                                        rf"document of {n} tokens, by prepare --heldout-fraction "
                                        rf"0.05\)"):
        load_corpus("tokens", str(tmp_path / "out"), 300, 64)


def test_a_glob_over_a_prepared_directory_reads_only_shards(tmp_path, tok_dir, inputs):
    root, _ = inputs
    out = tmp_path / "out"
    index = prepare([str(root / "txt")], out, str(tok_dir), heldout_fraction=0.0, workers=1,
                    progress=False)
    (out / "train-00009.bin.partial").write_bytes(b"\x01\x00" * 50)
    corpus = load_corpus("tokens", str(out / "*"), 300, 4, heldout_fraction=0.1)
    assert len(corpus.train[0].shards) == len([s for s in index["shards"] if s["tokens"]])


def test_cli(tmp_path, tok_dir, inputs, capsys):
    root, _ = inputs
    argv = [str(root / "docs.jsonl"), "--text-field", "body", "--tokenizer", str(tok_dir),
            "--workers", "1", "--no-progress"]
    assert main(argv + ["--out", str(tmp_path / "out")]) == 0
    assert "train tokens (" in capsys.readouterr().out
    assert main(argv + ["--out", str(tmp_path / "o"), "--heldout-fraction", "0.9"]) == 2
    assert "--heldout-fraction must be in [0, 0.5]" in capsys.readouterr().err


@pytest.mark.slow
def test_a_prepared_corpus_trains_and_generates_words(tmp_path, tok_dir, capsys):
    """Tokenizer -> prepare -> train (held-out loss falls) -> generate prints text."""
    from jaxmoe.config import config_from_dict
    from jaxmoe.generate import main as generate_main
    from jaxmoe.train import train

    (tmp_path / "corpus.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in sentences(3000, seed=2)))
    prepare([str(tmp_path / "corpus.jsonl")], tmp_path / "shards", str(tok_dir), workers=1,
            progress=False)
    cfg = config_from_dict({
        "model": {"vocab_size": 384, "d_model": 32, "num_layers": 2, "num_heads": 2,
                  "num_kv_heads": 1, "head_dim": 16},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32},
        "data": {"source": "tokens", "path": str(tmp_path / "shards"), "tokenizer": str(tok_dir)},
        "train": {"steps": 40, "batch_size": 16, "seq_len": 32, "eval_every": 0,
                  "eval_batches": 2, "run_dir": str(tmp_path / "run")},
        "optimizer": {"learning_rate": 3e-3, "warmup_steps": 4},
        "logging": {"log_every": 10, "progress": False}})
    corpus = load_corpus("tokens", cfg.data.path, 384, 32)
    summary = train(cfg, corpus)
    assert summary["heldout_loss"] < summary["heldout_loss_initial"] - 1.5
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    last = [r for r in records if "data_epoch" in r][-1]
    windows = corpus.train[0].tokens // 33  # one shard
    assert last["data_epoch"] == pytest.approx(40 * 16 / windows)
    assert last["data_seen"] == pytest.approx(min(1.0, 40 * 16 / windows))

    capsys.readouterr()
    argv = ["--checkpoint", str(tmp_path / "run"), "--prompt", "The quick", "--prompt", "A",
            "--max-new-tokens", "24", "--temperature", "0"]
    assert generate_main(argv) == 0
    texts = capsys.readouterr().out.rstrip("\n").split("\n" + "=" * 40 + "\n")
    tok = load_tokenizer(tok_dir)
    assert len(texts) == 2 and texts[0].startswith("The quick") and texts[1].startswith("A")
    for text in texts:
        assert tok.decode(tok.encode(text)) == text and len(text.split()) >= 3
    with pytest.raises(DataError, match="was made with the tokenizer .* but data.tokenizer is 'bytes'"):
        corpus.check_tokenizer(load_tokenizer("bytes").describe())


_PARENT = """
import multiprocessing, os, sys, time
from jaxmoe.data import prepare


def work(watch):
    if watch:
        prepare._end_with_parent(os.getppid())
    time.sleep(120)


if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=work, args=(sys.argv[1] == "1",))
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")  # a zombie has ended
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("watch", [True, False])
def test_workers_end_with_a_killed_parent(tmp_path, monkeypatch, watch):
    """SIGKILL gives prepare no time to stop its worker processes, which would write their
    units on; each worker watches its parent (`_end_with_parent`, installed by the pool's
    initializer) and exits within a second of its death. Companion: a spawned worker
    without the watch outlives its killed parent."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    parent = subprocess.Popen([sys.executable, str(script), "1" if watch else "0"],
                              stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    child = int(parent.stdout.readline())
    time.sleep(1.0)  # the child is running (its watch started)
    assert not _gone(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 3.0
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    ended = _gone(child)
    if not ended:
        os.kill(child, signal.SIGKILL)
    assert ended == watch
    # the pool's initializer is what installs it
    watched = []
    monkeypatch.setattr(prep, "_end_with_parent", watched.append)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    prep._init_worker("bytes")
    assert watched == [os.getppid()]
