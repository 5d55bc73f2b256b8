from pathlib import Path

import numpy as np
import pytest

from jaxmoe import data
from jaxmoe.data import BatchIterator, Corpus, DataError, heldout_batches, load_corpus

L = 16  # seq_len used throughout


def _bin(path: Path, values, dtype: str) -> Path:
    np.asarray(values, dtype=dtype).tofile(path)
    return path


# --- corpora -----------------------------------------------------------------------------

def test_stdlib_corpus():
    c = load_corpus("stdlib", None, vocab_size=256, seq_len=L)
    assert c.name.startswith("python-stdlib-")
    assert c.train.dtype == np.uint8 and c.heldout.dtype == np.uint8
    assert c.train.ndim == 1 and len(c.train) > 1_000_000
    frac = len(c.heldout) / (len(c.train) + len(c.heldout))
    assert 0.01 < frac < 0.15
    assert b"import " in c.train[:100_000].tobytes()
    again = load_corpus("stdlib", None, vocab_size=50_000, seq_len=L)
    assert np.array_equal(c.train, again.train) and np.array_equal(c.heldout, again.heldout)


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
    assert isinstance(c.train, np.memmap) and c.train.dtype == np.uint16
    assert len(c.train) == 900 and len(c.heldout) == 100
    assert np.array_equal(np.concatenate([c.train, c.heldout]), np.arange(1000) % 700)


def test_tokens_uint32_file(tmp_path):
    values = np.arange(500, dtype=np.uint32) + 70_000
    f = _bin(tmp_path / "t.bin", values, "<u4")
    c = load_corpus("tokens", str(f), vocab_size=80_000, seq_len=L, token_dtype="uint32")
    assert c.train.dtype == np.uint32
    assert np.array_equal(np.concatenate([c.train, c.heldout]), values)


def test_tokens_directory(tmp_path):
    _bin(tmp_path / "train.bin", np.arange(300), "<u2")
    _bin(tmp_path / "val.bin", np.arange(50)[::-1], "<u2")
    c = load_corpus("tokens", str(tmp_path), vocab_size=300, seq_len=L)
    assert np.array_equal(c.train, np.arange(300))
    assert np.array_equal(c.heldout, np.arange(50)[::-1])


def test_text_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("héllo wörld\n" * 50, encoding="utf-8")
    c = load_corpus("text", str(f), vocab_size=256, seq_len=L, heldout_fraction=0.2)
    raw = f.read_bytes()
    assert np.concatenate([c.train, c.heldout]).tobytes() == raw
    assert len(c.heldout) == int(len(raw) * 0.2)


def test_text_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_text("B" * 100)
    (tmp_path / "sub" / "a.py").write_text("A" * 100)
    (tmp_path / "skip.bin").write_bytes(b"\xff" * 100)
    c = load_corpus("text", str(tmp_path), vocab_size=256, seq_len=L, heldout_fraction=0.1)
    stream = np.concatenate([c.train, c.heldout]).tobytes()
    assert stream == b"B" * 100 + data.SEPARATOR + b"A" * 100  # sorted: "b.md" < "sub/a.py"


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


def test_batch_shape_dtype_and_windows():
    batch = BatchIterator(TOKENS, batch_size=8, seq_len=L, seed=0).batch_at(0)
    assert batch.shape == (8, L + 1) and batch.dtype == np.int32
    # tokens == arange, so each row is tokens[o:o+L+1] iff it is consecutive integers from o.
    assert np.array_equal(batch, batch[:, :1] + np.arange(L + 1))
    assert batch.min() >= 0 and batch.max() < len(TOKENS)


def test_windows_cover_full_range():
    tokens = np.arange(L + 3, dtype=np.uint16)  # only 3 valid start offsets
    it = BatchIterator(tokens, batch_size=64, seq_len=L, seed=1)
    assert set(it.batch_at(0)[:, 0]) == {0, 1, 2}


def test_batch_determinism():
    a = BatchIterator(TOKENS, 8, L, seed=3)
    b = BatchIterator(TOKENS, 8, L, seed=3)
    assert np.array_equal(a.batch_at(7), b.batch_at(7))
    assert not np.array_equal(a.batch_at(7), a.batch_at(8))
    assert not np.array_equal(a.batch_at(7), BatchIterator(TOKENS, 8, L, seed=4).batch_at(7))


def test_resume():
    it = BatchIterator(TOKENS, 4, L, seed=5)
    first = [next(it) for _ in range(5)]
    assert it.state() == {"step": 5, "seed": 5}
    resumed = BatchIterator(TOKENS, 4, L, seed=5, start_step=3)
    for expected, got in zip(first[3:], resumed):
        assert np.array_equal(expected, got)
    assert resumed.step == 5


def test_process_sharding():
    full = BatchIterator(TOKENS, 8, L, seed=9).batch_at(2)
    parts = [BatchIterator(TOKENS, 8, L, seed=9, process_index=p, process_count=2).batch_at(2)
             for p in range(2)]
    assert parts[0].shape == (4, L + 1)
    assert np.array_equal(np.concatenate(parts), full)


def test_memmap_batches(tmp_path):
    f = _bin(tmp_path / "t.bin", np.arange(2000), "<u2")
    c = load_corpus("tokens", str(f), vocab_size=2000, seq_len=L)
    batch = BatchIterator(c.train, 4, L, seed=0).batch_at(0)
    assert type(batch) is np.ndarray and batch.dtype == np.int32
    assert np.array_equal(batch, batch[:, :1] + np.arange(L + 1))


def test_batch_errors():
    with pytest.raises(DataError, match="batch_size 6 must be a positive multiple of process_count 4"):
        BatchIterator(TOKENS, 6, L, seed=0, process_count=4)
    with pytest.raises(DataError, match="process_index 2 not in"):
        BatchIterator(TOKENS, 4, L, seed=0, process_index=2, process_count=2)
    with pytest.raises(DataError, match=r"seq_len\+1 = 17"):
        BatchIterator(TOKENS[:10], 4, L, seed=0)
    with pytest.raises(DataError, match="batch_size 6 must be"):
        heldout_batches(TOKENS, 6, L, 2, process_count=4)


# --- held-out ----------------------------------------------------------------------------

def test_heldout_batches():
    batches = heldout_batches(TOKENS, batch_size=4, seq_len=L, num_batches=3)
    assert len(batches) == 3
    assert all(b.shape == (4, L + 1) and b.dtype == np.int32 for b in batches)
    starts = np.concatenate([b[:, 0] for b in batches])
    assert np.array_equal(starts, np.arange(12) * L)  # stride seq_len: each token predicted once
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


def test_corpus_is_frozen():
    c = Corpus("x", TOKENS, TOKENS)
    with pytest.raises(AttributeError):
        c.name = "y"  # type: ignore[misc]
