"""Corpora: the Python standard library's source, text files, or token shards.

Byte-level sources (stdlib, text) use each raw byte as a token (0..255) and join
files with a single 0x00 byte, which never occurs in Python source or ordinary
text, as a document separator.

`tokens` reads flat little-endian uint16/uint32 shards (`python -m jaxmoe.prepare`'s
output, OLMo/Dolma-style raw `.npy` shards, or any flat file), memory-mapped. Each
entry of `data.path` is one source of a mixture: a prepared directory (its
`index.json` says the shards' dtype, sizes and largest ids, and which are held
out), a shard file, or a glob of shards. Shards without an index are scanned once
for their largest id, and the result is cached beside them.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxmoe.tokenizer import BYTE_EOS, BYTE_TOKENIZER, BYTE_VOCAB

SOURCES = ("stdlib", "text", "tokens")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
TEXT_SUFFIXES = (".txt", ".md", ".py")
SEPARATOR = bytes([BYTE_EOS])
INDEX_FILE = "index.json"
INDEX_FORMAT = "jaxmoe-token-shards"
SCAN_SUFFIX = ".scan.json"  # beside an index-less shard: its size, dtype and id range
NOT_SHARDS = (".json", ".partial")  # skipped by globs
_NPY_MAGIC = b"\x93NUMPY"
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
_MAX_CHECK_CHUNK = 1 << 24  # tokens per chunk when scanning memmaps for the max id


class DataError(ValueError):
    """Invalid data configuration or corpus contents."""


@dataclass(frozen=True)
class Source:
    """One source of a training mixture: its shards (1-D token arrays) and weight."""
    name: str
    shards: tuple[np.ndarray, ...]
    weight: float = 1.0

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.shards)


@dataclass(frozen=True)
class Corpus:
    name: str
    train: tuple[Source, ...]
    heldout_sources: tuple[Source, ...]  # each training source's held-out shards, in order
    tokenizer: dict | None = None  # what the shards were made with, when recorded

    @property
    def heldout(self) -> tuple[np.ndarray, ...]:
        """Every source's held-out shards, one tuple."""
        return tuple(shard for source in self.heldout_sources for shard in source.shards)

    def check_tokenizer(self, described: dict) -> None:
        """A corpus prepared with one tokenizer must not be read with another."""
        if self.tokenizer and self.tokenizer.get("sha256") != described["sha256"]:
            raise DataError(f"corpus {self.name} was made with the tokenizer "
                            f"{self.tokenizer.get('spec')!r}, but data.tokenizer is "
                            f"{described['spec']!r}; set data.tokenizer to the corpus's tokenizer")


def load_corpus(source: str, path: str | tuple[str, ...] | list[str] | None, vocab_size: int,
                seq_len: int, heldout_fraction: float = 0.05, token_dtype: str = "uint16",
                weights: tuple[float, ...] | list[float] | None = None) -> Corpus:
    if source not in SOURCES:
        raise DataError(f"unknown data source {source!r}; valid sources: {', '.join(SOURCES)}")
    if not 0.0 < heldout_fraction <= 0.5:
        raise DataError(f"heldout_fraction must be in (0, 0.5], got {heldout_fraction}")
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    if source in ("stdlib", "text") and vocab_size < BYTE_VOCAB:
        raise DataError(f"vocab_size {vocab_size} < {BYTE_VOCAB}: byte-level source {source!r} "
                        f"needs all {BYTE_VOCAB} byte ids")
    byte_level = BYTE_TOKENIZER.describe()

    if source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        train, heldout = _stdlib_split(root, heldout_fraction)
        name = f"python-stdlib-{sys.version_info.major}.{sys.version_info.minor}"
        corpus = Corpus(name, (Source(name, (train,)),), (Source(name, (heldout,)),), byte_level)
    elif source == "text":
        if path is not None and not isinstance(path, str):
            raise DataError(f"data source 'text' takes one path (a file or directory), got {path!r}")
        p = _existing_path(source, path)
        train, heldout = _tail_split(_read_text(p), heldout_fraction)
        corpus = Corpus(str(p), (Source(str(p), (train,)),), (Source(str(p), (heldout,)),),
                        byte_level)
    else:
        corpus = _load_tokens(path, weights, vocab_size, heldout_fraction, token_dtype)

    for s in corpus.train:
        if s.tokens < seq_len + 1:
            raise DataError(f"corpus {s.name} has {s.tokens} train tokens; "
                            f"need at least seq_len+1 = {seq_len + 1}")
    held = sum(len(h) for h in corpus.heldout)
    if max((len(h) for h in corpus.heldout), default=0) < seq_len + 1:
        raise DataError(f"corpus {corpus.name} has {held} heldout tokens; "
                        f"need at least seq_len+1 = {seq_len + 1} in one shard")
    return corpus


def _existing_path(source: str, path: str | None) -> Path:
    if not path:
        raise DataError(f"data source {source!r} requires a path, got {path!r}")
    p = Path(path)
    if not p.exists():
        raise DataError(f"data path does not exist: {p}")
    return p


@functools.lru_cache(maxsize=4)
def stdlib_files(root: str, heldout_fraction: float) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(train, held-out) relative paths of the standard library's .py files under root."""
    train, heldout = [], []
    threshold = heldout_fraction * 1000
    for rel in walk_files(Path(root), (".py",), prune=_EXCLUDED_DIRS):
        # Hash of the relative path: the split is stable across file additions/removals.
        (heldout if zlib.crc32(rel.encode()) % 1000 < threshold else train).append(rel)
    return tuple(train), tuple(heldout)


@functools.lru_cache(maxsize=4)
def _stdlib_split(root: str, heldout_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    # frombuffer over bytes gives read-only arrays, so the cached values cannot be mutated.
    return tuple(np.frombuffer(SEPARATOR.join((Path(root) / rel).read_bytes() for rel in rels),
                               np.uint8) for rels in stdlib_files(root, heldout_fraction))


def walk_files(root: Path, suffixes: tuple[str, ...], prune: frozenset[str] = frozenset()) -> list[str]:
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
        data = SEPARATOR.join((p / rel).read_bytes() for rel in walk_files(p, TEXT_SUFFIXES))
    else:
        data = p.read_bytes()
    if not data:
        kind = f" (no non-empty {'/'.join(TEXT_SUFFIXES)} files)" if p.is_dir() else ""
        raise DataError(f"corpus {p} is empty{kind}")
    return np.frombuffer(data, np.uint8)


def _tail_split(tokens: np.ndarray, heldout_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = len(tokens) - int(len(tokens) * heldout_fraction)
    return tokens[:cut], tokens[cut:]


def _load_tokens(path, weights, vocab_size: int, heldout_fraction: float,
                 token_dtype: str) -> Corpus:
    if token_dtype not in TOKEN_DTYPES:
        raise DataError(f"unknown token_dtype {token_dtype!r}; valid: {', '.join(TOKEN_DTYPES)}")
    entries = [path] if isinstance(path, str) else list(path or [])
    if not entries:
        raise DataError(f"data source 'tokens' requires a path, got {path!r}")
    if weights is not None:
        if len(weights) != len(entries):
            raise DataError(f"data.weights has {len(weights)} weights for {len(entries)} "
                            f"data.path entries; give one weight per entry")
        if any(not w > 0 for w in weights):
            raise DataError(f"data.weights must all be positive, got {list(weights)}")
    sources, heldout, tokenizers = [], [], {}
    for i, entry in enumerate(entries):
        train, held, tokenizer = _token_source(str(entry), vocab_size, heldout_fraction,
                                               TOKEN_DTYPES[token_dtype])
        weight = 1.0 if weights is None else weights[i]
        sources.append(Source(str(entry), tuple(train), weight))
        heldout.append(Source(str(entry), tuple(held), weight))
        if tokenizer is not None:
            tokenizers.setdefault(tokenizer.get("sha256"), (entry, tokenizer))
    if len(tokenizers) > 1:
        (a, ta), (b, tb) = list(tokenizers.values())[:2]
        raise DataError(f"data.path mixes tokenizers: {a} was prepared with {ta.get('spec')!r}, "
                        f"{b} with {tb.get('spec')!r}; ids would mean different things")
    name = entries[0] if len(entries) == 1 else f"mixture of {len(entries)} sources"
    tokenizer = next(iter(tokenizers.values()))[1] if tokenizers else None
    return Corpus(name, tuple(sources), tuple(heldout), tokenizer)


def _token_source(entry: str, vocab_size: int, heldout_fraction: float, dtype: np.dtype):
    """(train shards, held-out shards, tokenizer record or None) of one data.path entry."""
    p = Path(entry).expanduser()
    if p.name == INDEX_FILE and p.is_file():
        p = p.parent
    if p.is_dir():
        if (p / INDEX_FILE).is_file():
            return _indexed(p, vocab_size, heldout_fraction)
        train_path, val_path = p / "train.bin", p / "val.bin"
        if train_path.is_file() or val_path.is_file():
            for f in (train_path, val_path):
                if not f.is_file():
                    raise DataError(f"token directory {p} must contain train.bin and val.bin; "
                                    f"missing {f}")
            return ([_raw_shard(train_path, dtype, vocab_size)],
                    [_raw_shard(val_path, dtype, vocab_size)], None)
        raise DataError(f"token directory {p} has no {INDEX_FILE}: make it with python -m "
                        f"jaxmoe.prepare, or name its shard files (a glob such as {p}/*.npy)")
    if glob.has_magic(entry):
        # a glob over a prepared directory must not read its index or unfinished files
        files = sorted(Path(f) for f in glob.glob(os.path.expanduser(entry))
                       if Path(f).is_file() and not f.endswith(NOT_SHARDS)
                       and Path(f).stat().st_size)
        if not files:
            raise DataError(f"data path {entry} matches no non-empty shard file")
    elif p.is_file():
        files = [p]
    else:
        raise DataError(f"data path does not exist: {p}")
    train, heldout = [], []
    for f in files:
        t, h = _tail_split(_raw_shard(f, dtype, vocab_size), heldout_fraction)
        train.append(t)
        heldout.append(h)
    return train, heldout, None


def _indexed(directory: Path, vocab_size: int, heldout_fraction: float):
    where = directory / INDEX_FILE
    try:
        index = json.loads(where.read_text())
        if index.get("format") != INDEX_FORMAT:
            raise ValueError(f"format {index.get('format')!r}, not {INDEX_FORMAT!r}")
        dtype = TOKEN_DTYPES[index["dtype"]]
        shards = [(directory / s["file"], s["split"], int(s["tokens"]), int(s["max_id"]))
                  for s in index["shards"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{where} is not a readable token index ({type(e).__name__}: {e}); "
                        f"re-run python -m jaxmoe.prepare") from None
    train, heldout = [], []
    for f, split, tokens, max_id in shards:
        if not f.is_file():
            raise DataError(f"shard {f} listed in {where} is missing")
        if f.stat().st_size != tokens * dtype.itemsize:
            raise DataError(f"shard {f} has {f.stat().st_size} bytes, but {where} says {tokens} "
                            f"{dtype.name} tokens: it was changed or not fully written; re-run "
                            f"python -m jaxmoe.prepare")
        if max_id >= vocab_size:
            raise DataError(f"shard {f} contains id {max_id} >= vocab_size {vocab_size} (per "
                            f"{where}); set model.vocab_size to the tokenizer's vocabulary")
        if tokens:
            (heldout if split == "val" else train).append(np.memmap(f, dtype=dtype, mode="r"))
    if not heldout:  # too few documents to hold any out: the tail of each shard instead
        pairs = [_tail_split(t, heldout_fraction) for t in train]
        train, heldout = [a for a, _ in pairs], [b for _, b in pairs]
    return train, heldout, index.get("tokenizer")


def _open_shard(f: Path, dtype: np.dtype) -> np.ndarray:
    """A 1-D memmap of a raw shard, or of a .npy file's array (its header gives the dtype)."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        is_npy = fh.read(len(_NPY_MAGIC)) == _NPY_MAGIC
    if is_npy:
        try:
            tokens = np.load(f, mmap_mode="r")
        except ValueError as e:
            raise DataError(f"token file {f} is not a readable .npy array ({e})") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise DataError(f"token file {f} holds a {tokens.dtype} array of shape {tokens.shape}; "
                            f"need 1-D integer tokens")
        return tokens
    if size % dtype.itemsize:
        raise DataError(f"token file {f} has {size} bytes, not a multiple of "
                        f"{dtype.itemsize} ({dtype.name}); wrong token_dtype?")
    if size == 0:
        raise DataError(f"corpus {f} is empty")
    return np.memmap(f, dtype=dtype, mode="r")


def _raw_shard(f: Path, dtype: np.dtype, vocab_size: int) -> np.ndarray:
    """An index-less shard, checked against the vocabulary. Its id range is found by a
    scan the first time and cached in a file beside it (when the directory is writable)."""
    tokens = _open_shard(f, dtype)
    if len(tokens) == 0:
        raise DataError(f"corpus {f} is empty")
    stat = f.stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": tokens.dtype.str}
    cache = f.with_name(f.name + SCAN_SUFFIX)
    max_id = min_id = None
    try:
        cached = json.loads(cache.read_text())
        if {k: cached.get(k) for k in key} == key:
            max_id, min_id = int(cached["max_id"]), int(cached["min_id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if max_id is None:
        chunks = [tokens[i:i + _MAX_CHECK_CHUNK] for i in range(0, len(tokens), _MAX_CHECK_CHUNK)]
        max_id, min_id = max(int(c.max()) for c in chunks), min(int(c.min()) for c in chunks)
        try:
            cache.write_text(json.dumps({**key, "max_id": max_id, "min_id": min_id}))
        except OSError:
            pass  # a read-only corpus is scanned at every start
    if min_id < 0:
        raise DataError(f"token file {f} contains the negative id {min_id}")
    if max_id >= vocab_size:
        raise DataError(f"token file {f} contains id {max_id} >= vocab_size {vocab_size}")
    return tokens
