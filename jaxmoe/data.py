"""Corpora (stdlib source, text, pre-tokenised .bin) and deterministic batch streams.

Byte-level sources use each raw byte as a token (0..255) and join files with a single
0x00 byte, which never occurs in Python source or ordinary text, as a document separator.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SOURCES = ("stdlib", "text", "tokens")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
TEXT_SUFFIXES = (".txt", ".md", ".py")
SEPARATOR = b"\x00"
BYTE_VOCAB = 256
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
_MAX_CHECK_CHUNK = 1 << 24  # tokens per chunk when scanning memmaps for the max id


class DataError(ValueError):
    """Invalid data configuration or corpus contents."""


@dataclass(frozen=True)
class Corpus:
    name: str
    train: np.ndarray  # 1-D integer tokens (possibly np.memmap)
    heldout: np.ndarray


def load_corpus(source: str, path: str | None, vocab_size: int, seq_len: int,
                heldout_fraction: float = 0.05, token_dtype: str = "uint16") -> Corpus:
    if source not in SOURCES:
        raise DataError(f"unknown data source {source!r}; valid sources: {', '.join(SOURCES)}")
    if not 0.0 < heldout_fraction <= 0.5:
        raise DataError(f"heldout_fraction must be in (0, 0.5], got {heldout_fraction}")
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    if source in ("stdlib", "text") and vocab_size < BYTE_VOCAB:
        raise DataError(f"vocab_size {vocab_size} < {BYTE_VOCAB}: byte-level source {source!r} "
                        f"needs all {BYTE_VOCAB} byte ids")

    if source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        train, heldout = _stdlib_split(root, heldout_fraction)
        corpus = Corpus(f"python-stdlib-{sys.version_info.major}.{sys.version_info.minor}",
                        train, heldout)
    else:
        p = _existing_path(source, path)
        if source == "text":
            corpus = Corpus(str(p), *_tail_split(_read_text(p), heldout_fraction))
        else:
            corpus = _load_tokens(p, vocab_size, heldout_fraction, token_dtype)

    for split in ("train", "heldout"):
        n = len(getattr(corpus, split))
        if n < seq_len + 1:
            raise DataError(f"corpus {corpus.name} has {n} {split} tokens; "
                            f"need at least seq_len+1 = {seq_len + 1}")
    return corpus


def _existing_path(source: str, path: str | None) -> Path:
    if not path:
        raise DataError(f"data source {source!r} requires a path, got {path!r}")
    p = Path(path)
    if not p.exists():
        raise DataError(f"data path does not exist: {p}")
    return p


@functools.lru_cache(maxsize=4)
def _stdlib_split(root: str, heldout_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    train: list[bytes] = []
    heldout: list[bytes] = []
    threshold = heldout_fraction * 1000
    for rel in _walk(Path(root), (".py",), prune=_EXCLUDED_DIRS):
        # Hash of the relative path: the split is stable across file additions/removals.
        dest = heldout if zlib.crc32(rel.encode()) % 1000 < threshold else train
        dest.append((Path(root) / rel).read_bytes())
    # frombuffer over bytes gives read-only arrays, so the cached values cannot be mutated.
    return (np.frombuffer(SEPARATOR.join(train), np.uint8),
            np.frombuffer(SEPARATOR.join(heldout), np.uint8))


def _walk(root: Path, suffixes: tuple[str, ...], prune: frozenset[str] = frozenset()) -> list[str]:
    """Relative POSIX paths of files under root with the given suffixes, sorted."""
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in prune]
        for f in filenames:
            if f.endswith(suffixes):
                rels.append((Path(dirpath) / f).relative_to(root).as_posix())
    return sorted(rels)


def _read_text(p: Path) -> np.ndarray:
    if p.is_dir():
        data = SEPARATOR.join((p / rel).read_bytes() for rel in _walk(p, TEXT_SUFFIXES))
    else:
        data = p.read_bytes()
    if not data:
        kind = f" (no non-empty {'/'.join(TEXT_SUFFIXES)} files)" if p.is_dir() else ""
        raise DataError(f"corpus {p} is empty{kind}")
    return np.frombuffer(data, np.uint8)


def _tail_split(tokens: np.ndarray, heldout_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = len(tokens) - int(len(tokens) * heldout_fraction)
    return tokens[:cut], tokens[cut:]


def _load_tokens(p: Path, vocab_size: int, heldout_fraction: float, token_dtype: str) -> Corpus:
    if token_dtype not in TOKEN_DTYPES:
        raise DataError(f"unknown token_dtype {token_dtype!r}; valid: {', '.join(TOKEN_DTYPES)}")
    dtype = TOKEN_DTYPES[token_dtype]
    if p.is_dir():
        train_path, val_path = p / "train.bin", p / "val.bin"
        for f in (train_path, val_path):
            if not f.is_file():
                raise DataError(f"token directory {p} must contain train.bin and val.bin; missing {f}")
        train = _memmap(train_path, dtype, vocab_size)
        heldout = _memmap(val_path, dtype, vocab_size)
    else:
        train, heldout = _tail_split(_memmap(p, dtype, vocab_size), heldout_fraction)
    return Corpus(str(p), train, heldout)


def _memmap(f: Path, dtype: np.dtype, vocab_size: int) -> np.ndarray:
    size = f.stat().st_size
    if size % dtype.itemsize:
        raise DataError(f"token file {f} has {size} bytes, not a multiple of "
                        f"{dtype.itemsize} ({dtype.name}); wrong token_dtype?")
    if size == 0:
        raise DataError(f"corpus {f} is empty")
    tokens = np.memmap(f, dtype=dtype, mode="r")
    max_id = max(int(tokens[i:i + _MAX_CHECK_CHUNK].max())
                 for i in range(0, len(tokens), _MAX_CHECK_CHUNK))
    if max_id >= vocab_size:
        raise DataError(f"token file {f} contains id {max_id} >= vocab_size {vocab_size}")
    return tokens


def _rows_per_process(batch_size: int, process_index: int, process_count: int) -> int:
    if batch_size < 1 or process_count < 1 or batch_size % process_count:
        raise DataError(f"batch_size {batch_size} must be a positive multiple of "
                        f"process_count {process_count}")
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} not in [0, {process_count})")
    return batch_size // process_count


def _check_length(tokens: np.ndarray, seq_len: int) -> None:
    if seq_len < 1 or tokens.ndim != 1 or len(tokens) < seq_len + 1:
        raise DataError(f"need a 1-D token array with at least seq_len+1 = {seq_len + 1} tokens, "
                        f"got shape {tokens.shape}")


class BatchIterator:
    """Deterministic, resumable stream of fixed-shape training batches.

    Global batch `step` is a pure function of (tokens, seed, step): `batch_size` random
    windows of seq_len+1 tokens. Every process draws all offsets and keeps its own rows,
    so hosts agree without communication and resuming is just `start_step`.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 process_index: int = 0, process_count: int = 1, start_step: int = 0):
        _check_length(tokens, seq_len)
        if seed < 0 or start_step < 0:
            raise DataError(f"seed and start_step must be >= 0, got seed={seed}, "
                            f"start_step={start_step}")
        self.rows = _rows_per_process(batch_size, process_index, process_count)
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.process_index = process_index
        self.step = start_step
        self._window_L = np.arange(seq_len + 1)

    def batch_at(self, step: int) -> np.ndarray:
        """int32 [batch_size // process_count, seq_len + 1]: this process's rows of batch `step`."""
        rng = np.random.default_rng([self.seed, step])
        offsets_B = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        start = self.process_index * self.rows
        offsets_b = offsets_B[start:start + self.rows]
        return self.tokens[offsets_b[:, None] + self._window_L].astype(np.int32)

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> np.ndarray:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state(self) -> dict:
        return {"step": self.step, "seed": self.seed}


def heldout_batches(tokens: np.ndarray, batch_size: int, seq_len: int, num_batches: int,
                    process_index: int = 0, process_count: int = 1) -> list[np.ndarray]:
    """Fixed eval set: windows of seq_len+1 at stride seq_len (each token predicted once),
    taken in order from the start and wrapping if there are too few."""
    _check_length(tokens, seq_len)
    rows = _rows_per_process(batch_size, process_index, process_count)
    num_windows = (len(tokens) - 1) // seq_len
    window_L = np.arange(seq_len + 1)
    batches = []
    for j in range(num_batches):
        first = j * batch_size + process_index * rows
        offsets_b = (np.arange(first, first + rows) % num_windows) * seq_len
        batches.append(tokens[offsets_b[:, None] + window_L].astype(np.int32))
    return batches
