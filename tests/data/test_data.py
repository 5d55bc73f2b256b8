import json
import os
from pathlib import Path

import numpy as np
import pytest

from jaxmoe.data import corpus as data
from jaxmoe.data.batches import MIX_PERIOD, BatchIterator, Prefetcher, heldout_batches, permute
from jaxmoe.data.corpus import Corpus, DataError, Source, load_corpus

L = 16  # seq_len used throughout


def _bin(path: Path, values, dtype: str) -> Path:
    np.asarray(values, dtype=dtype).tofile(path)
    return path


def _train(c: Corpus) -> np.ndarray:
    """The training tokens of a one-source, one-shard corpus."""
    (source,) = c.train
    (shard,) = source.shards
    return shard


def _heldout(c: Corpus) -> np.ndarray:
    (shard,) = c.heldout
    return shard


# --- corpora -----------------------------------------------------------------------------

def test_stdlib_corpus():
    c = load_corpus("stdlib", None, vocab_size=256, seq_len=L)
    assert c.name.startswith("python-stdlib-")
    assert _train(c).dtype == np.uint8 and _heldout(c).dtype == np.uint8
    assert _train(c).ndim == 1 and len(_train(c)) > 1_000_000
    frac = len(_heldout(c)) / (len(_train(c)) + len(_heldout(c)))
    assert 0.01 < frac < 0.15
    assert b"import " in _train(c)[:100_000].tobytes()
    again = load_corpus("stdlib", None, vocab_size=50_000, seq_len=L)
    assert np.array_equal(_train(c), _train(again)) and np.array_equal(_heldout(c), _heldout(again))


def test_stdlib_split_is_by_file():
    train, heldout = data._stdlib_split(data.sysconfig.get_paths()["stdlib"], 0.05)
    train_docs = set(train.tobytes().split(data.SEPARATOR))
    heldout_docs = heldout.tobytes().split(data.SEPARATOR)
    assert len(heldout_docs) > 10
    # Large held-out files never appear in train (small ones, e.g. empty __init__.py, may repeat).
    assert not {d for d in heldout_docs if len(d) > 2000} & train_docs


def test_tokens_uint16_file(tmp_path):
    f = _bin(tmp_path / "t.bin", np.arange(1000) % 700, "<u2")
    c = load_corpus("tokens", str(f), vocab_size=700, seq_len=L, heldout_fraction=0.1)
    assert isinstance(_train(c), np.memmap) and _train(c).dtype == np.uint16
    assert len(_train(c)) == 900 and len(_heldout(c)) == 100
    assert np.array_equal(np.concatenate([_train(c), _heldout(c)]), np.arange(1000) % 700)


def test_tokens_uint32_file(tmp_path):
    values = np.arange(500, dtype=np.uint32) + 70_000
    f = _bin(tmp_path / "t.bin", values, "<u4")
    c = load_corpus("tokens", str(f), vocab_size=80_000, seq_len=L, token_dtype="uint32")
    assert _train(c).dtype == np.uint32
    assert np.array_equal(np.concatenate([_train(c), _heldout(c)]), values)


def test_tokens_directory(tmp_path):
    _bin(tmp_path / "train.bin", np.arange(300), "<u2")
    _bin(tmp_path / "val.bin", np.arange(50)[::-1], "<u2")
    c = load_corpus("tokens", str(tmp_path), vocab_size=300, seq_len=L)
    assert np.array_equal(_train(c), np.arange(300))
    assert np.array_equal(_heldout(c), np.arange(50)[::-1])


def test_text_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("héllo wörld\n" * 50, encoding="utf-8")
    c = load_corpus("text", str(f), vocab_size=256, seq_len=L, heldout_fraction=0.2)
    raw = f.read_bytes()
    assert np.concatenate([_train(c), _heldout(c)]).tobytes() == raw
    assert len(_heldout(c)) == int(len(raw) * 0.2)


def test_text_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_text("B" * 100)
    (tmp_path / "sub" / "a.py").write_text("A" * 100)
    (tmp_path / "skip.bin").write_bytes(b"\xff" * 100)
    c = load_corpus("text", str(tmp_path), vocab_size=256, seq_len=L, heldout_fraction=0.1)
    stream = np.concatenate([_train(c), _heldout(c)]).tobytes()
    assert stream == b"B" * 100 + data.SEPARATOR + b"A" * 100  # sorted: "b.md" < "sub/a.py"


def test_text_directory_refuses_skips_or_replaces_bad_text_and_counts(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("good text " * 20)
    (tmp_path / "b-empty.md").write_text("")
    (tmp_path / "c-latin1.txt").write_bytes("caf\u00e9 ".encode("latin-1") * 20)
    (tmp_path / "d-binary.py").write_bytes(b"\x7fELF\x02\x01\x00\x00")
    (tmp_path / "e.csv").write_text("a,b")
    with pytest.raises(DataError, match=r"c-latin1.txt: byte 3 \(0xe9\) is not UTF-8; convert it "
                                        r"to UTF-8, or set data.bad_text: replace .*or skip"):
        load_corpus("text", str(tmp_path), 256, L)
    with pytest.raises(DataError, match=r"d-binary.py: byte 6 is NUL: a binary file, not text; "
                                        r"remove it, or set data.bad_text: skip"):
        load_corpus("text", str(tmp_path), 256, L, bad_text="replace")
    assert capsys.readouterr().err == ""  # nothing but the error
    c = load_corpus("text", str(tmp_path), 256, L, heldout_fraction=0.1, bad_text="skip")
    assert np.concatenate([_train(c), _heldout(c)]).tobytes() == b"good text " * 20
    assert capsys.readouterr().err == (f"text corpus {tmp_path}: read 1 file; skipped 4: 1 file "
                                       f"by suffix (.csv 1), 1 empty, 1 binary, 1 not UTF-8\n")
    (tmp_path / "d-binary.py").unlink()
    c = load_corpus("text", str(tmp_path), 256, L, heldout_fraction=0.1, bad_text="replace")
    stream = np.concatenate([_train(c), _heldout(c)]).tobytes()
    assert stream == b"good text " * 20 + data.SEPARATOR + "caf\ufffd ".encode() * 20
    assert "replaced 20 non-UTF-8 bytes with U+FFFD in 1 file" in capsys.readouterr().err
    with pytest.raises(DataError, match="unknown bad_text 'ignore'"):
        load_corpus("text", str(tmp_path), 256, L, bad_text="ignore")


def test_a_small_text_heldout_split_names_its_cause(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 300)
    with pytest.raises(DataError, match=r"has 15 heldout tokens; need at least seq_len\+1 = 17 in "
                                        r"one shard, the largest has 15 \(held out: the last 0.05 "
                                        r"of its 300 bytes\)"):
        load_corpus("text", str(tmp_path / "a.txt"), 256, L)


# --- fingerprints ------------------------------------------------------------------------

def test_the_fingerprint_follows_the_data_not_paths_or_times(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        _bin(tmp_path / d / "t.bin", np.arange(1000) % 700, "<u2")
    a = load_corpus("tokens", str(tmp_path / "a" / "t.bin"), 700, L).fingerprint
    assert len(a) == 16 and int(a, 16) >= 0
    os.utime(tmp_path / "b" / "t.bin", ns=(1, 1))  # elsewhere, another time, the same tokens
    assert load_corpus("tokens", str(tmp_path / "b" / "t.bin"), 700, L).fingerprint == a
    other = {load_corpus("tokens", str(tmp_path / "a" / "t.bin"), 700, L,
                         heldout_fraction=0.1).fingerprint,  # another split
             load_corpus("tokens", str(tmp_path / "a" / "t.bin"), 1 << 30, L, token_dtype="uint32",
                         ).fingerprint,  # the same bytes read as other tokens
             load_corpus("tokens", [str(tmp_path / "a" / "t.bin")] * 2, 700, L).fingerprint}
    _bin(tmp_path / "b" / "t.bin", np.arange(1, 1001) % 700, "<u2")
    other.add(load_corpus("tokens", str(tmp_path / "b" / "t.bin"), 700, L).fingerprint)
    assert len(other) == 4 and a not in other
    script = (f"from jaxmoe.data.corpus import load_corpus; print(load_corpus('tokens', "
              f"{str(tmp_path / 'a' / 't.bin')!r}, 700, {L}).fingerprint)")
    import subprocess
    import sys
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True).stdout.strip() == a  # no per-process salt

    stdlib = load_corpus("stdlib", None, 256, L)
    assert stdlib.fingerprint == load_corpus("stdlib", None, 256, L).fingerprint
    assert stdlib.fingerprint != load_corpus("stdlib", None, 256, L, heldout_fraction=0.1).fingerprint
    (tmp_path / "doc.txt").write_text("some text " * 40)
    text = load_corpus("text", str(tmp_path / "doc.txt"), 256, L).fingerprint
    (tmp_path / "doc.txt").write_text("some tExt " * 40)
    assert load_corpus("text", str(tmp_path / "doc.txt"), 256, L).fingerprint != text


def test_a_prepared_corpus_is_fingerprinted_from_its_index(tmp_path, monkeypatch):
    from jaxmoe.data.prepare import prepare
    from tiny_tokenizer import make_tokenizer, sentences
    (tmp_path / "doc.txt").write_text(" ".join(sentences(60)))
    out = tmp_path / "out"
    index = prepare([str(tmp_path / "doc.txt")], out, str(make_tokenizer(tmp_path / "tok")),
                    heldout_fraction=0.0, workers=1, progress=False)
    monkeypatch.setattr(data, "_scan", lambda *a: pytest.fail("the shards were read"))
    fingerprint = load_corpus("tokens", str(out), 300, L).fingerprint
    monkeypatch.undo()
    for s in index["shards"]:
        del s["sha256"]  # as an index of version 1: the shards are hashed instead
    (out / "index.json").write_text(json.dumps(index))
    assert load_corpus("tokens", str(out), 300, L).fingerprint == fingerprint
    shard = out / index["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[2:] + shard.read_bytes()[:2])  # the same size
    assert load_corpus("tokens", str(out), 300, L).fingerprint != fingerprint


# --- validation --------------------------------------------------------------------------

def test_unknown_source():
    with pytest.raises(DataError, match=r"unknown data source 'web'.*stdlib, text, tokens"):
        load_corpus("web", None, 256, L)


@pytest.mark.parametrize("fraction", [0.0, 0.6, -0.1])
def test_bad_heldout_fraction(fraction):
    with pytest.raises(DataError, match="heldout_fraction"):
        load_corpus("stdlib", None, 256, L, heldout_fraction=fraction)


@pytest.mark.parametrize("source", ["text", "tokens"])
def test_path_required(source):
    with pytest.raises(DataError, match=f"'{source}' requires a path"):
        load_corpus(source, None, 50_000, L)


def test_path_missing(tmp_path):
    with pytest.raises(DataError, match="does not exist.*nope.bin"):
        load_corpus("tokens", str(tmp_path / "nope.bin"), 50_000, L)


def test_byte_vocab_too_small(tmp_path):
    with pytest.raises(DataError, match="vocab_size 100 < 256"):
        load_corpus("stdlib", None, 100, L)


def test_bad_file_size(tmp_path):
    f = tmp_path / "odd.bin"
    f.write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="odd.bin has 3 bytes, not a multiple of 2"):
        load_corpus("tokens", str(f), 50_000, L)


def test_bad_token_dtype(tmp_path):
    f = _bin(tmp_path / "t.bin", np.arange(100), "<u2")
    with pytest.raises(DataError, match="unknown token_dtype 'int8'"):
        load_corpus("tokens", str(f), 50_000, L, token_dtype="int8")


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty.bin is empty"):
        load_corpus("tokens", str(tmp_path / "empty.bin"), 50_000, L)
    with pytest.raises(DataError, match="empty.txt is empty"):
        load_corpus("text", str(tmp_path / "empty.txt"), 256, L)
    with pytest.raises(DataError, match="is empty"):
        load_corpus("text", str(tmp_path), 256, L)  # directory with only empty files


def test_too_few_tokens(tmp_path):
    f = _bin(tmp_path / "t.bin", np.arange(100), "<u2")
    with pytest.raises(DataError, match=r"has 5 heldout tokens; need at least seq_len\+1 = 17"):
        load_corpus("tokens", str(f), 50_000, L)
    with pytest.raises(DataError, match=r"has 95 train tokens; need at least seq_len\+1 = 201"):
        load_corpus("tokens", str(f), 50_000, 200)


def test_token_id_out_of_vocab(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_MAX_CHECK_CHUNK", 64)  # exercise the chunked scan
    values = np.arange(1000) % 500
    values[777] = 60_000
    f = _bin(tmp_path / "t.bin", values, "<u2")
    with pytest.raises(DataError, match="t.bin contains id 60000 >= vocab_size 50000"):
        load_corpus("tokens", str(f), 50_000, L)


def test_val_bin_missing(tmp_path):
    _bin(tmp_path / "train.bin", np.arange(100), "<u2")
    with pytest.raises(DataError, match="missing .*val.bin"):
        load_corpus("tokens", str(tmp_path), 50_000, L)


# --- batches -----------------------------------------------------------------------------

TOKENS = np.arange(10_000, dtype=np.uint16)
L1 = L + 1


def _window_ids(batch: np.ndarray) -> np.ndarray:
    """Over arange tokens, a row's first token names its window."""
    assert np.array_equal(batch, batch[:, :1] + np.arange(L1))  # consecutive tokens
    return batch[:, 0]


def test_batch_shape_dtype_and_windows():
    batch = BatchIterator(TOKENS, batch_size=8, seq_len=L, seed=0).batch_at(0)
    assert batch.shape == (8, L1) and batch.dtype == np.int32
    starts = _window_ids(batch)
    assert (starts % L1 == 0).all() and batch.max() < len(TOKENS)  # windows tile the shard


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_permute_is_a_bijection(n):
    got = permute(np.arange(n), n, key=7)
    assert sorted(got.tolist()) == list(range(n))
    if n > 16:
        assert not np.array_equal(got, np.arange(n))
        assert not np.array_equal(got, permute(np.arange(n), n, key=8))


def test_every_window_once_per_epoch_across_shards():
    # three shards of 5, 3 and 4 windows (their tails too short for another)
    shards = [np.arange(a, a + k * L1 + r, dtype=np.uint16)
              for a, k, r in [(0, 5, 3), (1000, 3, 0), (2000, 4, L)]]
    it = BatchIterator(shards, batch_size=4, seq_len=L, seed=2)
    windows = [(a + i * L1) for a, k in [(0, 5), (1000, 3), (2000, 4)] for i in range(k)]
    seen = np.concatenate([_window_ids(it.batch_at(s)) for s in range(6)])  # 2 epochs of 12
    for epoch in (seen[:12], seen[12:]):
        assert sorted(epoch.tolist()) == windows  # each once, none overlapping another
    assert not np.array_equal(seen[:12], seen[12:])  # each epoch has its own order
    assert it.progress(3) == {"epoch": 1.0, "seen": 1.0}
    assert it.progress(1) == {"epoch": 4 / 12, "seen": 4 / 12}


def test_mixture_weights_hold_and_each_source_walks_its_epochs():
    a = np.arange(0, 40 * L1, dtype=np.uint16)
    b = np.arange(40_000, 40_000 + 60 * L1, dtype=np.uint16)
    it = BatchIterator([Source("a", (a,), 1.0), Source("b", (b,), 3.0)], batch_size=64,
                       seq_len=L, seed=0)
    starts = np.concatenate([_window_ids(it.batch_at(s)) for s in range(2 * MIX_PERIOD // 64)])
    from_b = starts >= 40_000
    assert from_b.sum() == 2 * MIX_PERIOD * 3 // 4  # each period holds the weights exactly
    within = from_b[:MIX_PERIOD // 2].mean()  # half a period: a draw without replacement
    assert abs(within - 0.75) < 4 * np.sqrt(0.75 * 0.25 / (MIX_PERIOD // 2) / 2)
    for own, n in ((starts[~from_b], 40), (starts[from_b], 60)):
        first = own[:n]
        assert len(set(first.tolist())) == n  # a full epoch of the source before any repeat
    only_b = BatchIterator([Source("b", (b,))], 32, L, seed=0).batch_at(0)
    assert not np.array_equal(only_b, it.batch_at(0)[:32])


def test_batch_determinism():
    a = BatchIterator(TOKENS, 8, L, seed=3)
    b = BatchIterator(TOKENS, 8, L, seed=3)
    assert np.array_equal(a.batch_at(7), b.batch_at(7))
    assert not np.array_equal(a.batch_at(7), a.batch_at(8))
    assert not np.array_equal(a.batch_at(7), BatchIterator(TOKENS, 8, L, seed=4).batch_at(7))


def test_resume_and_prefetch_give_the_same_stream():
    it = BatchIterator(TOKENS, 4, L, seed=5)
    first = [next(it) for _ in range(5)]
    assert it.state() == {"step": 5, "seed": 5}
    resumed = BatchIterator(TOKENS, 4, L, seed=5, start_step=3)
    for expected, got in zip(first[3:], resumed):
        assert np.array_equal(expected, got)
    assert resumed.step == 5
    with Prefetcher(BatchIterator(TOKENS, 4, L, seed=5, start_step=1), depth=3) as ahead:
        for expected in first[1:]:
            assert np.array_equal(next(ahead), expected)
        assert ahead.state() == {"step": 5, "seed": 5}
    assert not ahead._thread.is_alive()  # leaving the block ends the reading thread


def test_prefetch_hands_on_errors():
    class Broken(BatchIterator):
        def batch_at(self, step):
            raise OSError(f"disk gone at step {step}")
    with Prefetcher(Broken(TOKENS, 4, L, seed=0, start_step=2), depth=2) as ahead:
        for _ in range(2):  # the same error again, not a vaguer one
            with pytest.raises(OSError, match="disk gone at step 2"):
                next(ahead)


def test_process_sharding():
    full = BatchIterator(TOKENS, 8, L, seed=9).batch_at(2)
    parts = [BatchIterator(TOKENS, 8, L, seed=9, process_index=p, process_count=2).batch_at(2)
             for p in range(2)]
    assert parts[0].shape == (4, L1)
    assert np.array_equal(np.concatenate(parts), full)


def test_memmap_batches(tmp_path):
    f = _bin(tmp_path / "t.bin", np.arange(2000), "<u2")
    c = load_corpus("tokens", str(f), vocab_size=2000, seq_len=L)
    batch = BatchIterator(c.train, 4, L, seed=0).batch_at(0)
    assert type(batch) is np.ndarray and batch.dtype == np.int32
    assert np.array_equal(batch, batch[:, :1] + np.arange(L1))


def test_batch_errors():
    with pytest.raises(DataError, match="batch_size 6 must be a positive multiple of process_count 4"):
        BatchIterator(TOKENS, 6, L, seed=0, process_count=4)
    with pytest.raises(DataError, match="process_index 2 not in"):
        BatchIterator(TOKENS, 4, L, seed=0, process_index=2, process_count=2)
    with pytest.raises(DataError, match=r"no shard holds seq_len\+1 = 17"):
        BatchIterator(TOKENS[:10], 4, L, seed=0)
    with pytest.raises(DataError, match="batch_size 6 must be"):
        heldout_batches(TOKENS, 6, L, 2, process_count=4)


# --- sources: shards, globs, .npy, indexes, mixtures -------------------------------------

def test_shard_globs_npy_and_a_mixture(tmp_path):
    for i in range(3):
        _bin(tmp_path / f"part-{i}.bin", np.arange(200) + 100 * i, "<u2")
    np.save(tmp_path / "other.npy", np.arange(300, dtype=np.uint32) + 5000)  # header says u4
    c = load_corpus("tokens", [str(tmp_path / "part-*.bin"), str(tmp_path / "other.npy")],
                    vocab_size=6000, seq_len=L, heldout_fraction=0.1, weights=[2.0, 1.0])
    assert [s.name for s in c.train] == [str(tmp_path / "part-*.bin"), str(tmp_path / "other.npy")]
    assert [len(s.shards) for s in c.train] == [3, 1] and [s.weight for s in c.train] == [2.0, 1.0]
    assert [len(x) for x in c.train[0].shards] == [180] * 3 and c.train[1].shards[0].dtype == "<u4"
    assert [len(h) for h in c.heldout] == [20, 20, 20, 30]  # each shard's tail
    batch = BatchIterator(c.train, 8, L, seed=0).batch_at(0)
    assert np.array_equal(batch, batch[:, :1] + np.arange(L1))


def test_index_less_shards_are_scanned_once(tmp_path):
    f = _bin(tmp_path / "t.bin", np.arange(1000) % 700, "<u2")
    load_corpus("tokens", str(f), 700, L)
    cache = tmp_path / ("t.bin" + data.SCAN_SUFFIX)
    record = json.loads(cache.read_text())
    assert record["max_id"] == 699
    cache.write_text(json.dumps({**record, "max_id": 9999}))  # read instead of a new scan
    with pytest.raises(DataError, match="t.bin contains id 9999 >= vocab_size 700"):
        load_corpus("tokens", str(f), 700, L)
    _bin(f, np.arange(1000) % 600, "<u2")  # a changed file is scanned again
    os.utime(f, ns=(1, 1))
    load_corpus("tokens", str(f), 700, L)
    assert json.loads(cache.read_text())["max_id"] == 599


def test_bad_sources_are_named(tmp_path):
    f = _bin(tmp_path / "t.bin", np.arange(500), "<u2")
    with pytest.raises(DataError, match="matches no non-empty shard file"):
        load_corpus("tokens", str(tmp_path / "*.nope"), 600, L)
    with pytest.raises(DataError, match="2 weights for 1 data.path entries"):
        load_corpus("tokens", str(f), 600, L, weights=[1.0, 2.0])
    with pytest.raises(DataError, match=f"{tmp_path.name} has no index.json"):
        load_corpus("tokens", str(tmp_path), 600, L)
    small = _bin(tmp_path / "small.bin", np.arange(4 * L1 + 8), "<u2")
    c = load_corpus("tokens", str(small), 600, L, heldout_fraction=0.25)  # 57 train tokens
    with pytest.raises(DataError, match=r"small.bin has 3 windows of seq_len\+1 = 17 tokens, "
                                        r"fewer than its 4 rows of one batch"):
        BatchIterator(c.train, 4, L, seed=0)
    (tmp_path / "odd.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(DataError, match="odd.npy is not a readable .npy array"):
        load_corpus("tokens", str(tmp_path / "odd.npy"), 600, L)


def test_a_changed_indexed_shard_is_refused(tmp_path):
    from jaxmoe.data.prepare import prepare
    from tiny_tokenizer import make_tokenizer, sentences
    (tmp_path / "doc.txt").write_text(" ".join(sentences(60)))
    out = tmp_path / "out"
    index = prepare([str(tmp_path / "doc.txt")], out, str(make_tokenizer(tmp_path / "tok")),
                    heldout_fraction=0.0, workers=1, progress=False)
    c = load_corpus("tokens", str(out / "index.json"), 300, L, heldout_fraction=0.1)
    assert c.train[0].tokens + sum(len(h) for h in c.heldout) == index["totals"]["train"]["tokens"]
    with pytest.raises(DataError, match=r"contains id \d+ >= vocab_size 100 \(per .*index.json\)"):
        load_corpus("tokens", str(out), 100, L)
    shard = out / index["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=f"shard {shard} has .* bytes, but .* says"):
        load_corpus("tokens", str(out), 300, L)
    shard.unlink()
    with pytest.raises(DataError, match=f"shard {shard} listed in .* is missing"):
        load_corpus("tokens", str(out), 300, L)


# --- held-out ----------------------------------------------------------------------------

def test_heldout_batches():
    batches = heldout_batches(TOKENS, batch_size=4, seq_len=L, num_batches=3)
    assert len(batches) == 3
    assert all(b.shape == (4, L + 1) and b.dtype == np.int32 for b in batches)
    starts = np.concatenate([b[:, 0] for b in batches])
    windows = (len(TOKENS) - 1) // L  # at stride seq_len: each token predicted once
    assert np.array_equal(starts, (np.arange(12) * windows // 12) * L)  # spread over all
    again = heldout_batches(TOKENS, 4, L, 3)
    assert all(np.array_equal(x, y) for x, y in zip(batches, again))


def test_heldout_batches_wrap_and_shard():
    tokens = np.arange(3 * L + 1, dtype=np.uint16)  # exactly 3 windows
    batches = heldout_batches(tokens, batch_size=4, seq_len=L, num_batches=2)
    assert list(np.concatenate([b[:, 0] for b in batches])) == [0, L, 2 * L, 0, L, 2 * L, 0, L]
    assert all(np.array_equal(b, b[:, :1] + np.arange(L + 1)) for b in batches)
    full = heldout_batches(TOKENS, 8, L, 2)
    parts = [heldout_batches(TOKENS, 8, L, 2, process_index=p, process_count=2) for p in range(2)]
    for j in range(2):
        assert np.array_equal(np.concatenate([parts[0][j], parts[1][j]]), full[j])


def test_heldout_batches_reach_every_source_of_a_mixture():
    shards = [np.arange(0, 40 * L + 1), np.arange(5000, 5000 + 40 * L + 1)]
    starts = np.concatenate(heldout_batches(shards, 4, L, 2))[:, 0]
    assert (starts < 5000).sum() == 4 and (starts >= 5000).sum() == 4


def test_tiny_weights_still_get_a_slot():
    from jaxmoe.data.batches import quotas
    q = quotas([1.0, 1e-9, 1e-9])
    assert q.sum() == MIX_PERIOD and q.min() == 1
    assert quotas([3, 1]).tolist() == [MIX_PERIOD * 3 // 4, MIX_PERIOD // 4]


def test_corpus_is_frozen():
    c = Corpus("x", (Source("x", (TOKENS,)),), (Source("x", (TOKENS,)),))
    with pytest.raises(AttributeError):
        c.name = "y"  # type: ignore[misc]
