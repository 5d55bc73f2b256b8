"""Corpora: the Python standard library's source, text files, or token shards.

Byte-level sources (stdlib, text) use each raw byte as a token (0..255) and join
files with a single 0x00 byte, which never occurs in Python source or ordinary
text, as a document separator. The text source reads UTF-8 text only: a file with
a NUL byte (binary) or bytes that are not UTF-8 is refused, naming the byte,
unless `bad_text` says to skip it or (not UTF-8 only) to decode its bad bytes as
U+FFFD; empty files and, in a directory, files of other suffixes are skipped. One
line on stderr counts what was read and skipped.

`tokens` reads flat little-endian uint16/uint32 shards (`python -m jaxmoe.data.prepare`'s
output, OLMo/Dolma-style raw `.npy` shards, or any flat file), memory-mapped. Each
entry of `data.path` is one source of a mixture: a prepared directory (its
`index.json` says the shards' dtype, sizes, largest ids and SHA-256s, and which
are held out), a shard file, or a glob of shards. Shards without an index are
scanned once for their id range and SHA-256, and the result is cached beside them.

`Corpus.fingerprint` names the data a run trains on: 16 hex digits of a SHA-256
over the tokenizer's digest and, for each source in order, the slices its train
and held-out splits are made of, each as (SHA-256 of the whole array's bytes,
dtype, start, stop). It follows the contents, not the paths or file times, and
leaves out the mixture weights. Prepared shards' digests are read from their
index (not re-checked against the shards, whose sizes are); the other arrays are
hashed as they are read.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import sys
import sysconfig
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxmoe.data.tokenizer import BYTE_EOS, BYTE_TOKENIZER, BYTE_VOCAB

SOURCES = ("stdlib", "text", "tokens")
BAD_TEXT = ("refuse", "replace", "skip")  # what to do with a file that is not UTF-8 text
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
TEXT_SUFFIXES = (".txt", ".md", ".py")
SEPARATOR = bytes([BYTE_EOS])
INDEX_FILE = "index.json"
INDEX_FORMAT = "jaxmoe-token-shards"
SCAN_SUFFIX = ".scan.json"  # beside an index-less shard: its size, dtype, id range, SHA-256
NOT_SHARDS = (".json", ".partial")  # skipped by globs
_NPY_MAGIC = b"\x93NUMPY"
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
_MAX_CHECK_CHUNK = 1 << 24  # tokens per chunk when scanning memmaps


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
    fingerprint: str = ""  # of the data (module docstring); "" for a corpus made by hand

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


@dataclass(frozen=True)
class _Read:
    """One data.path entry as read: its train and held-out arrays, each with the slice it
    is, (digest of the whole array, dtype, start, stop), and where its held-out tokens
    came from (for the error when they are too few)."""
    train: tuple[tuple[np.ndarray, tuple], ...]
    heldout: tuple[tuple[np.ndarray, tuple], ...]
    heldout_origin: str
    tokenizer: dict | None = None


def load_corpus(source: str, path: str | tuple[str, ...] | list[str] | None, vocab_size: int,
                seq_len: int, heldout_fraction: float = 0.05, token_dtype: str = "uint16",
                weights: tuple[float, ...] | list[float] | None = None,
                bad_text: str = "refuse") -> Corpus:
    if source not in SOURCES:
        raise DataError(f"unknown data source {source!r}; valid sources: {', '.join(SOURCES)}")
    if not 0.0 < heldout_fraction <= 0.5:
        raise DataError(f"heldout_fraction must be in (0, 0.5], got {heldout_fraction}")
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    if bad_text not in BAD_TEXT:
        raise DataError(f"unknown bad_text {bad_text!r}; valid: {', '.join(BAD_TEXT)}")
    if source in ("stdlib", "text") and vocab_size < BYTE_VOCAB:
        raise DataError(f"vocab_size {vocab_size} < {BYTE_VOCAB}: byte-level source {source!r} "
                        f"needs all {BYTE_VOCAB} byte ids")
    byte_level = BYTE_TOKENIZER.describe()
    report = None

    if source == "stdlib":
        name = f"python-stdlib-{sys.version_info.major}.{sys.version_info.minor}"
        train, heldout = _stdlib_split(sysconfig.get_paths()["stdlib"], heldout_fraction)
        entries = [(name, _Read((_whole(train),), (_whole(heldout),),
                                "the files whose path hashes into heldout_fraction"))]
        tokenizer = byte_level
    elif source == "text":
        if path is not None and not isinstance(path, str):
            raise DataError(f"data source 'text' takes one path (a file or directory), got {path!r}")
        p = _existing_path(source, path)
        tokens, counts = read_text(p, bad_text)
        report = f"text corpus {p}: {describe_counts(counts, 'files')}"
        name = str(p)
        origin = f"the last {heldout_fraction:g} of its {len(tokens):,} bytes"
        entries = [(name, _tail_reads([_whole(tokens)], heldout_fraction, origin))]
        tokenizer = byte_level
    else:
        name, entries, tokenizer = _load_tokens(path, weights, vocab_size, heldout_fraction,
                                                token_dtype)

    weights = [1.0] * len(entries) if weights is None else list(weights)
    corpus = Corpus(name,
                    tuple(Source(n, tuple(a for a, _ in r.train), w)
                          for (n, r), w in zip(entries, weights)),
                    tuple(Source(n, tuple(a for a, _ in r.heldout), w)
                          for (n, r), w in zip(entries, weights)),
                    tokenizer, _fingerprint(tokenizer, [r for _, r in entries]))
    for s in corpus.train:
        if s.tokens < seq_len + 1:
            raise DataError(f"corpus {s.name} has {s.tokens} train tokens; "
                            f"need at least seq_len+1 = {seq_len + 1}")
    held = sum(len(h) for h in corpus.heldout)
    largest = max((len(h) for h in corpus.heldout), default=0)
    if largest < seq_len + 1:
        origins = "; ".join(f"{n}: {r.heldout_origin}" if len(entries) > 1 else r.heldout_origin
                            for n, r in entries)
        raise DataError(f"corpus {corpus.name} has {held} heldout tokens; need at least "
                        f"seq_len+1 = {seq_len + 1} in one shard, the largest has {largest} "
                        f"(held out: {origins})")
    if report:
        print(report, file=sys.stderr)
    return corpus


def _whole(tokens: np.ndarray, digest: str | None = None) -> tuple[np.ndarray, tuple]:
    """An array and the slice that is all of it, named by its contents' SHA-256 (hashed
    here when not given)."""
    digest = digest or hashlib.sha256(np.ascontiguousarray(tokens)).hexdigest()
    return tokens, (digest, tokens.dtype.str, 0, len(tokens))


def _fingerprint(tokenizer: dict | None, reads: list[_Read]) -> str:
    what = {"tokenizer": tokenizer and tokenizer.get("sha256"),
            "sources": [{"train": [s for _, s in r.train], "heldout": [s for _, s in r.heldout]}
                        for r in reads]}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


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


def walk_files(root: Path, suffixes: tuple[str, ...], prune: frozenset[str] = frozenset(),
               skipped: Counter | None = None) -> list[str]:
    """Relative POSIX paths of files under root with the given suffixes, sorted; the
    others are counted in `skipped` ("skipped suffix .ext": n)."""
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in prune]
        for f in filenames:
            if f.endswith(suffixes):
                rels.append((Path(dirpath) / f).relative_to(root).as_posix())
            elif skipped is not None:
                skipped[f"skipped suffix {Path(f).suffix or '(none)'}"] += 1
    return sorted(rels)


# ---------------------------------------------------------------- text that may be bad


def text_problem(raw: bytes) -> tuple[str, int] | None:
    """Why bytes are not UTF-8 text, and the offset that shows it: ("binary", the first
    NUL byte) or ("not UTF-8", the first byte of an invalid sequence); None for text."""
    nul = raw.find(b"\0")
    if nul >= 0:
        return "binary", nul
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return "not UTF-8", e.start
    return None


def bad_text_message(where: str, problem: str, at: int, value: int, option: str) -> str:
    """One line: what is wrong with the input at `where` (byte `at` holds `value`), and
    the `option` that would take it."""
    if problem == "binary":
        return (f"{where}: byte {at} is NUL: a binary file, not text; remove it, or set "
                f"{option} skip")
    return (f"{where}: byte {at} (0x{value:02x}) is not UTF-8; convert it to UTF-8, or set "
            f"{option} replace (bad bytes become U+FFFD) or skip")


def decode_text(raw: bytes, where: str, bad_text: str, counts: Counter, option: str,
                start: int = 0) -> str | None:
    """The text of raw bytes (byte `start` onwards of the input `where`), or None to skip
    them, as `bad_text` says; what is skipped or replaced is counted, what is refused
    raised, naming `option`."""
    problem = text_problem(raw)
    if problem is None:
        return raw.decode("utf-8")
    kind, at = problem
    if bad_text == "skip":
        counts[f"skipped {kind}"] += 1
        return None
    if bad_text != "replace" or kind == "binary":
        raise DataError(bad_text_message(where, kind, start + at, raw[at], option))
    # bytes that are not part of a valid UTF-8 sequence
    counts["replaced bytes"] += len(raw) - len(raw.decode("utf-8", "ignore").encode("utf-8"))
    counts["replaced in"] += 1
    return raw.decode("utf-8", "replace")


def describe_counts(counts: dict[str, int], noun: str) -> str:
    """One line from counts of "read", "skipped <reason>", "skipped suffix <.ext>",
    "replaced bytes" and "replaced in" (how many of `noun`, a plural)."""
    counts = Counter(counts)

    def some(n: int, plural: str) -> str:
        return f"{n:,} {plural if n != 1 else plural[:-1]}"

    by_suffix = sorted((k.rsplit(" ", 1)[1], n) for k, n in counts.items()
                       if k.startswith("skipped suffix ") and n)
    reasons = [f"{some(sum(n for _, n in by_suffix), 'files')} by suffix "
               f"({', '.join(f'{s} {n:,}' for s, n in by_suffix)})"] if by_suffix else []
    reasons += [f"{counts[f'skipped {r}']:,} {r}" for r in ("empty", "binary", "not UTF-8")
                if counts[f"skipped {r}"]]
    skipped = sum(n for k, n in counts.items() if k.startswith("skipped "))
    line = f"read {some(counts['read'], noun)}; skipped " + (
        f"{skipped:,}: {', '.join(reasons)}" if reasons else "none")
    if counts["replaced bytes"]:
        line += (f"; replaced {some(counts['replaced bytes'], 'non-UTF-8 bytes')} with U+FFFD "
                 f"in {some(counts['replaced in'], noun)}")
    return line


def read_text(p: Path, bad_text: str) -> tuple[np.ndarray, Counter]:
    """The bytes of a text file, or of a directory's .txt/.md/.py files joined by
    SEPARATOR, and counts of what was read and skipped (describe_counts)."""
    counts = Counter()
    rels = walk_files(p, TEXT_SUFFIXES, skipped=counts) if p.is_dir() else [""]
    texts = []
    for rel in rels:
        f = p / rel if rel else p
        raw = f.read_bytes()
        if not raw.strip():
            counts["skipped empty"] += 1
            continue
        text = decode_text(raw, str(f), bad_text, counts, "data.bad_text:")
        if text is not None:
            counts["read"] += 1
            texts.append(text.encode("utf-8"))
    if not texts:
        kind = f" of {'/'.join(TEXT_SUFFIXES)} text" if p.is_dir() else ""
        raise DataError(f"corpus {p} is empty{kind} ({describe_counts(counts, 'files')})")
    return np.frombuffer(SEPARATOR.join(texts), np.uint8), counts


# ---------------------------------------------------------------- token shards


def _tail_split(tokens: np.ndarray, heldout_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = len(tokens) - int(len(tokens) * heldout_fraction)
    return tokens[:cut], tokens[cut:]


def _load_tokens(path, weights, vocab_size: int, heldout_fraction: float, token_dtype: str):
    """(name, [(entry, _Read)], tokenizer record or None) of a tokens source."""
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
    reads, tokenizers = [], {}
    for entry in entries:
        read = _token_source(str(entry), vocab_size, heldout_fraction, TOKEN_DTYPES[token_dtype])
        reads.append((str(entry), read))
        if read.tokenizer is not None:
            tokenizers.setdefault(read.tokenizer.get("sha256"), (entry, read.tokenizer))
    if len(tokenizers) > 1:
        (a, ta), (b, tb) = list(tokenizers.values())[:2]
        raise DataError(f"data.path mixes tokenizers: {a} was prepared with {ta.get('spec')!r}, "
                        f"{b} with {tb.get('spec')!r}; ids would mean different things")
    name = entries[0] if len(entries) == 1 else f"mixture of {len(entries)} sources"
    tokenizer = next(iter(tokenizers.values()))[1] if tokenizers else None
    return name, reads, tokenizer


def _token_source(entry: str, vocab_size: int, heldout_fraction: float, dtype: np.dtype) -> _Read:
    """One data.path entry's shards."""
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
            return _Read((_raw_shard(train_path, dtype, vocab_size),),
                         (_raw_shard(val_path, dtype, vocab_size),), f"all of {val_path}")
        raise DataError(f"token directory {p} has no {INDEX_FILE}: make it with python -m "
                        f"jaxmoe.data.prepare, or name its shard files (a glob such as {p}/*.npy)")
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
    return _tail_reads([_raw_shard(f, dtype, vocab_size) for f in files], heldout_fraction,
                       f"the last {heldout_fraction:g} of each shard")


def _tail_reads(shards: list[tuple[np.ndarray, tuple]], heldout_fraction: float, origin: str,
                tokenizer: dict | None = None) -> _Read:
    """Whole shards (_whole), each cut into train and its last heldout_fraction, held out."""
    train, heldout = [], []
    for tokens, (digest, dtype, _, n) in shards:
        a, b = _tail_split(tokens, heldout_fraction)
        train.append((a, (digest, dtype, 0, len(a))))
        heldout.append((b, (digest, dtype, len(a), n)))
    return _Read(tuple(train), tuple(heldout), origin, tokenizer)


def _indexed(directory: Path, vocab_size: int, heldout_fraction: float) -> _Read:
    where = directory / INDEX_FILE
    try:
        index = json.loads(where.read_text())
        if index.get("format") != INDEX_FORMAT:
            raise ValueError(f"format {index.get('format')!r}, not {INDEX_FORMAT!r}")
        dtype = TOKEN_DTYPES[index["dtype"]]
        shards = [(directory / s["file"], s["split"], int(s["tokens"]), int(s["max_id"]),
                   s.get("sha256")) for s in index["shards"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{where} is not a readable token index ({type(e).__name__}: {e}); "
                        f"re-run python -m jaxmoe.data.prepare") from None
    train, heldout = [], []
    for f, split, tokens, max_id, digest in shards:
        if not f.is_file():
            raise DataError(f"shard {f} listed in {where} is missing")
        if f.stat().st_size != tokens * dtype.itemsize:
            raise DataError(f"shard {f} has {f.stat().st_size} bytes, but {where} says {tokens} "
                            f"{dtype.name} tokens: it was changed or not fully written; re-run "
                            f"python -m jaxmoe.data.prepare")
        if max_id >= vocab_size:
            raise DataError(f"shard {f} contains id {max_id} >= vocab_size {vocab_size} (per "
                            f"{where}); set model.vocab_size to the tokenizer's vocabulary")
        if tokens:
            shard = np.memmap(f, dtype=dtype, mode="r")
            digest = digest or _scan(f, shard)["sha256"]  # an index of version 1 records none
            (heldout if split == "val" else train).append(_whole(shard, digest))
    if not heldout:  # too few documents to hold any out: the tail of each shard instead
        return _tail_reads(train, heldout_fraction, f"the last {heldout_fraction:g} of each "
                           f"shard (prepare held out no document)", index.get("tokenizer"))
    val = index.get("totals", {}).get("val", {})
    return _Read(tuple(train), tuple(heldout),
                 f"{val.get('documents')} document{'s' * (val.get('documents') != 1)} of "
                 f"{val.get('tokens')} tokens, by prepare --heldout-fraction "
                 f"{index.get('heldout_fraction')}",
                 index.get("tokenizer"))


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


def _raw_shard(f: Path, dtype: np.dtype, vocab_size: int) -> tuple[np.ndarray, tuple]:
    """An index-less shard, checked against the vocabulary (_whole)."""
    tokens = _open_shard(f, dtype)
    if len(tokens) == 0:
        raise DataError(f"corpus {f} is empty")
    scan = _scan(f, tokens)
    if scan["min_id"] < 0:
        raise DataError(f"token file {f} contains the negative id {scan['min_id']}")
    if scan["max_id"] >= vocab_size:
        raise DataError(f"token file {f} contains id {scan['max_id']} >= vocab_size {vocab_size}")
    return _whole(tokens, scan["sha256"])


def _scan(f: Path, tokens: np.ndarray) -> dict:
    """A shard's smallest and largest ids and the SHA-256 of its tokens' bytes: read the
    first time and cached in a file beside it (when the directory is writable), valid
    while the shard's size and mtime stay."""
    stat = f.stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": tokens.dtype.str}
    cache = f.with_name(f.name + SCAN_SUFFIX)
    try:
        cached = json.loads(cache.read_text())
        if {k: cached.get(k) for k in key} == key:
            return {"min_id": int(cached["min_id"]), "max_id": int(cached["max_id"]),
                    "sha256": str(cached["sha256"])}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest, lows, highs = hashlib.sha256(), [], []
    for i in range(0, len(tokens), _MAX_CHECK_CHUNK):
        chunk = np.ascontiguousarray(tokens[i:i + _MAX_CHECK_CHUNK])
        digest.update(chunk)
        lows.append(int(chunk.min()))
        highs.append(int(chunk.max()))
    scan = {"min_id": min(lows), "max_id": max(highs), "sha256": digest.hexdigest()}
    try:
        cache.write_text(json.dumps({**key, **scan}))
    except OSError:
        pass  # a read-only corpus is scanned at every start
    return scan
