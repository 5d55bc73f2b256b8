"""python -m jaxmoe.data.prepare INPUT... --tokenizer TOKENIZER --out DIR

Tokenizes a corpus into flat token shards for `data.source: tokens`. Inputs are
text files (one document each), directories of them (.txt, .md, .py, and .jsonl
files; the others are skipped and counted), JSON Lines files (`.jsonl`, `.json`,
optionally `.gz`; one document per line, in the field `--text-field`), or a Hugging
Face `datasets` dataset saved with `save_to_disk` (one document per row). Every
document is followed by one EOS; a document goes to the held-out split when a hash
of its text says so (`--heldout-fraction`), so duplicates always land on the same
side. Empty documents (whitespace at most) are skipped. A file or line that is
binary (holds a NUL byte) or not UTF-8 is refused, naming the file and byte, unless
`--bad-text` says to skip it or (not UTF-8 only) to decode its bad bytes as U+FFFD.
The index counts what was read, skipped (by reason) and replaced; so does the last
line printed.

The work is cut into units of about `--unit-mb` of input, tokenized by parallel
worker processes. Unit u writes `train-u.bin` and `val-u.bin` (little-endian
uint16 when the vocabulary fits, else uint32) under temporary names, renames them
when complete, and records them in `unit-u.json` last; `index.json`, which the
loader reads, is written when every unit is done, with each shard's SHA-256.

`prepare.json` records the plan: the inputs, the size and SHA-256 of every file
read (hashed again only when its size or mtime moved), the tokenizer and the
options. Interrupted, a second run with the same plan resumes from the units
already recorded; an unfinished preparation of another plan is discarded. A
finished preparation is never replaced unless `--rebuild` says so: a run with
other inputs or options names what changed and stops.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import hashlib
import json
import multiprocessing
import os
import re
import sys
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxmoe.data.corpus import (BAD_TEXT, INDEX_FILE, INDEX_FORMAT, SCAN_SUFFIX, TEXT_SUFFIXES,
                         DataError, bad_text_message, decode_text, describe_counts, text_problem,
                         walk_files)
from jaxmoe.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer

PLAN_FILE = "prepare.json"
PARTIAL = ".partial"
JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
DIRECTORY_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".jsonl.gz")  # a .json in a tree may be anything
DATASET_MARKERS = ("dataset_info.json", "state.json")  # what save_to_disk writes
ROWS_PER_UNIT = 20_000  # dataset rows per unit
HASH_THREADS = 8  # files read at once while planning (hashing releases the GIL)


class PrepareError(ValueError):
    """Inputs or an output directory that cannot be prepared."""


@dataclass(frozen=True)
class Unit:
    """One piece of work: text files, a byte range of a JSON Lines file (the lines that
    start in it), or a range of a saved dataset's rows."""
    kind: str  # text | jsonl | dataset
    paths: tuple[str, ...]
    start: int = 0
    stop: int = -1


# ---------------------------------------------------------------- planning


def _is_dataset(p: Path) -> bool:
    return p.is_dir() and all((p / m).is_file() for m in DATASET_MARKERS)


def find_inputs(inputs: list[str]) -> tuple[list[tuple[str, str]], Counter]:
    """(kind, absolute path) of every text file, JSON Lines file and saved dataset the
    inputs name, in order, and the count of files in their directories skipped for
    their suffix."""
    found, skipped = [], Counter()
    for raw in inputs:
        p = Path(raw).expanduser().absolute()
        if not p.exists():
            raise PrepareError(f"input {raw} does not exist")
        if (p / "dataset_dict.json").is_file():
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
            raise PrepareError(f"input {raw} is a DatasetDict; name one split's directory "
                               f"(one of: {', '.join(str(p / s) for s in splits)})")
        if _is_dataset(p):
            found.append(("dataset", str(p)))
            continue
        if p.is_dir():
            files = [p / rel for rel in walk_files(p, DIRECTORY_SUFFIXES, skipped=skipped)]
            if not files:
                raise PrepareError(f"input directory {raw} holds no "
                                   f"{'/'.join(DIRECTORY_SUFFIXES)} files")
        else:
            files = [p]  # named: taken whatever its suffix
        found += [("jsonl" if f.name.endswith(JSONL_SUFFIXES) else "text", str(f)) for f in files]
    return found, skipped


def _inspect(kind: str, path: str, known: dict[str, dict]) -> list[tuple[dict, int]]:
    """What the plan records of the files behind one input, each with its mtime before
    it was read: path, size and SHA-256, and for a text file what makes it no document
    ("empty", "binary", "not UTF-8") with the byte that shows it. `known` holds the
    records of files whose size and mtime have not moved: those are not read again."""
    files = sorted(f for f in Path(path).rglob("*") if f.is_file()) if kind == "dataset" \
        else [Path(path)]
    records = []
    for f in files:
        mtime = f.stat().st_mtime_ns
        if str(f) in known:
            records.append((known[str(f)], mtime))
        elif kind != "text":
            with open(f, "rb") as fh:
                size, digest = os.fstat(fh.fileno()).st_size, hashlib.file_digest(fh, "sha256")
            records.append(({"path": str(f), "bytes": size, "sha256": digest.hexdigest()}, mtime))
        else:
            raw = f.read_bytes()
            record = {"path": str(f), "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
            if not raw.strip():
                record["problem"] = "empty"
            elif problem := text_problem(raw):
                record.update(problem=problem[0], at=problem[1], value=raw[problem[1]])
            records.append((record, mtime))
    return records


def inspect_inputs(found: list[tuple[str, str]], known: dict[str, dict],
                   progress: bool) -> list[list[tuple[dict, int]]]:
    """_inspect of every input, several files at once."""
    with concurrent.futures.ThreadPoolExecutor(HASH_THREADS) as pool, \
            tqdm(total=len(found), unit="input", disable=not progress, desc="hashing") as bar:
        futures = [pool.submit(_inspect, kind, path, known) for kind, path in found]
        for future in concurrent.futures.as_completed(futures):
            bar.update()
        return [future.result() for future in futures]


def take(found: list[tuple[str, str]], records: list[list[dict]],
         bad_text: str) -> tuple[list[tuple[str, str, int]], Counter]:
    """(kind, path, bytes) of the inputs to read, and the count of text files skipped by
    reason; a file `bad_text` does not take is an error."""
    taken, skipped, refused = [], Counter(), []
    for (kind, path), recs in zip(found, records):
        problem = recs[0].get("problem") if kind == "text" else None
        if problem == "empty" or problem and bad_text == "skip":
            skipped[f"skipped {problem}"] += 1
        elif problem and not (problem == "not UTF-8" and bad_text == "replace"):
            refused.append(recs[0])
        else:
            taken.append((kind, path, sum(r["bytes"] for r in recs)))
    if refused:
        r = refused[0]
        k = len(refused) - 1
        more = f" ({k} more binary or non-UTF-8 file{'s' * (k > 1)})" * (k > 0)
        raise PrepareError(bad_text_message(r["path"], r["problem"], r["at"], r["value"],
                                            "--bad-text") + more)
    return taken, skipped


def plan_units(taken: list[tuple[str, str, int]], unit_bytes: int) -> list[Unit]:
    """The inputs taken cut into units, in a fixed order (a pure function of them)."""
    units: list[Unit] = []
    texts: list[tuple[str, int]] = []
    for kind, path, size in taken:
        if kind == "dataset":
            rows = _dataset(path, "").num_rows
            units += [Unit("dataset", (path,), a, min(a + ROWS_PER_UNIT, rows))
                      for a in range(0, rows, ROWS_PER_UNIT)]
        elif kind == "jsonl" and not path.endswith(".gz") and size > unit_bytes:
            units += [Unit("jsonl", (path,), a, min(a + unit_bytes, size))
                      for a in range(0, size, unit_bytes)]
        elif kind == "jsonl":
            units.append(Unit("jsonl", (path,), 0, -1))
        else:
            texts.append((path, size))
    group, group_bytes = [], 0
    for f, size in texts:  # small text files share a unit
        if group and group_bytes + size > unit_bytes:
            units.append(Unit("text", tuple(group)))
            group, group_bytes = [], 0
        group.append(f)
        group_bytes += size
    if group:
        units.append(Unit("text", tuple(group)))
    return units


def plan_changes(old: dict, new: dict) -> str:
    """What differs between an earlier plan and this one, in words."""
    if "files" not in old:
        return "it was made by an earlier jaxmoe.data.prepare, which recorded no content hashes"
    before = {f["path"]: f["sha256"] for f in old["files"]}
    now = {f["path"]: f["sha256"] for f in new["files"]}
    said = []
    for word, paths in (("changed", [p for p in now if p in before and before[p] != now[p]]),
                        ("added", [p for p in now if p not in before]),
                        ("removed", [p for p in before if p not in now])):
        if paths:
            more = f" and {len(paths) - 2} more" if len(paths) > 2 else ""
            said.append(f"{len(paths)} file{'s' * (len(paths) > 1)} {word}: "
                        f"{', '.join(paths[:2])}{more}")
    if not said and old.get("inputs") != new["inputs"]:
        said.append(f"the inputs were {' '.join(old.get('inputs', []))}")
    if old.get("tokenizer") != new["tokenizer"]:
        said.append("another tokenizer")
    for key in ("text_field", "heldout_fraction", "unit_mb", "bad_text"):
        if old.get(key) != new[key]:
            said.append(f"--{key.replace('_', '-')} was {old.get(key)}, now {new[key]}")
    return "; ".join(said) or "a field of prepare.json"


# ---------------------------------------------------------------- reading documents


def _dataset(path: str, text_field: str):
    try:
        import datasets
    except ImportError:
        raise PrepareError(f"input {path} is a saved Hugging Face dataset; reading it needs "
                           f"the `datasets` package: pip install datasets") from None
    ds = datasets.load_from_disk(path)
    if text_field and text_field not in ds.column_names:
        raise PrepareError(f"dataset {path} has no column {text_field!r} (columns: "
                           f"{', '.join(ds.column_names)}); pass --text-field")
    return ds


def _jsonl_lines(path: str, start: int, stop: int):
    """(line number or None, offset, bytes) of the lines that start in [start, stop); a
    .gz file is read whole, its lines numbered, its offsets in uncompressed bytes."""
    if path.endswith(".gz"):
        at = 0
        with gzip.open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                yield number, at, line
                at += len(line)
        return
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()  # the line holding byte start-1 belongs to the previous unit
        while stop < 0 or f.tell() < stop:
            at = f.tell()
            line = f.readline()
            if not line:
                return
            yield None, at, line


def _decode(raw: bytes, where: str, start: int, bad_text: str, counts: Counter) -> str | None:
    try:
        return decode_text(raw, where, bad_text, counts, "--bad-text", start)
    except DataError as e:
        raise PrepareError(str(e)) from None


def documents(unit: Unit, text_field: str, bad_text: str, counts: Counter):
    """The unit's documents, as strings; the empty ones and those `bad_text` skips are
    counted in `counts` instead."""
    def nonempty(texts):
        for text in texts:
            if text is None:
                continue
            if not text.strip():
                counts["skipped empty"] += 1
                continue
            counts["read"] += 1
            yield text

    if unit.kind == "text":
        yield from nonempty(_decode(Path(f).read_bytes(), f, 0, bad_text, counts)
                            for f in unit.paths)
    elif unit.kind == "jsonl":
        yield from nonempty(_jsonl_texts(unit, text_field, bad_text, counts))
    else:
        ds = _dataset(unit.paths[0], text_field)
        for text in ds.select(range(unit.start, unit.stop))[text_field]:
            if not isinstance(text, str):
                raise PrepareError(f"dataset {unit.paths[0]}: column {text_field!r} holds "
                                   f"{type(text).__name__}, not text")
            yield from nonempty([text])


def _jsonl_texts(unit: Unit, text_field: str, bad_text: str, counts: Counter):
    path = unit.paths[0]
    for number, at, raw in _jsonl_lines(path, unit.start, unit.stop):
        if not raw.strip():
            continue
        where = f"line {number}" if number else f"byte {at}"
        line = _decode(raw, f"{path} (line {number}, uncompressed)" if number else path, at,
                       bad_text, counts)
        if line is None:
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise PrepareError(f"{path} ({where}): not a JSON line ({e})") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise PrepareError(f"{path} ({where}): no string field {text_field!r}; pass "
                               f"--text-field with the field that holds the text")
        yield text


def is_heldout(text: str, fraction: float) -> bool:
    return zlib.crc32(text.encode("utf-8", errors="replace")) < fraction * 2**32


# ---------------------------------------------------------------- one unit

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_spec: str, in_a_pool: bool = True) -> None:
    global _worker_tokenizer
    if in_a_pool:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
        _end_with_parent(os.getppid())
    _worker_tokenizer = load_tokenizer(tokenizer_spec)


def _end_with_parent(parent: int, every_s: float = 0.5) -> None:
    """A pool worker exits within `every_s` of its parent's death (SIGKILL leaves it no
    time to stop its workers, which would write their units on for minutes): a daemon
    thread watches for the worker being handed to another parent."""
    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _write(path: Path, tokens: np.ndarray) -> None:
    partial = path.with_name(path.name + PARTIAL)
    with open(partial, "wb") as f:
        tokens.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def tokenize_unit(out: str, number: int, unit: Unit, text_field: str, heldout_fraction: float,
                  dtype: str, bad_text: str = "refuse", batch: int = 256) -> dict:
    """Tokenizes one unit into its two shards and records it; returns the record."""
    tokenizer = _worker_tokenizer
    np_dtype = np.dtype(dtype).newbyteorder("<")
    parts = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    read = Counter()
    texts: list[str] = []

    def tokenize_pending():
        for text, ids in zip(texts, tokenizer.encode_documents(texts)):
            split = "val" if is_heldout(text, heldout_fraction) else "train"
            parts[split].append(np.asarray(ids, np_dtype))
            counts[split] += 1
        texts.clear()

    for text in documents(unit, text_field, bad_text, read):
        texts.append(text)
        if len(texts) >= batch:
            tokenize_pending()
    tokenize_pending()
    record = {"unit": number, "shards": [], "counts": dict(read)}
    for split in ("train", "val"):
        tokens = np.concatenate(parts[split]) if parts[split] else np.zeros(0, np_dtype)
        name = f"{split}-{number:05d}.bin"
        _write(Path(out) / name, tokens)
        record["shards"].append({"file": name, "split": split, "tokens": int(len(tokens)),
                                 "documents": counts[split],
                                 "max_id": int(tokens.max()) if len(tokens) else -1,
                                 "sha256": hashlib.sha256(tokens).hexdigest()})
    _write_json(Path(out) / f"unit-{number:05d}.json", record)  # last: the unit is done now
    return record


def _write_json(path: Path, value) -> None:
    """Whole or not at all, even across a power cut."""
    partial = path.with_name(path.name + PARTIAL)
    with open(partial, "w") as f:
        f.write(json.dumps(value, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


# ---------------------------------------------------------------- the whole job


OUR_FILES = re.compile(rf"((train|val)-\d{{5}}\.bin({re.escape(SCAN_SUFFIX)})?|unit-\d{{5}}\.json"
                       rf"|{re.escape(INDEX_FILE)}|{re.escape(PLAN_FILE)})({re.escape(PARTIAL)})?")


def _earlier(out: Path) -> dict:
    """What `out` holds of an earlier run: {"plan", "mtime_ns"} (empty when nothing
    readable; a plan of version 1 is the whole file)."""
    try:
        recorded = json.loads((out / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    return recorded if "plan" in recorded else {"plan": recorded, "mtime_ns": {}}


def _known(earlier: dict) -> dict[str, dict]:
    """The earlier plan's records of the files whose size and mtime have not moved since."""
    mtimes, known = earlier.get("mtime_ns", {}), {}
    for record in earlier.get("plan", {}).get("files", []):
        try:
            st = os.stat(record["path"])
        except OSError:
            continue
        if st.st_size == record["bytes"] and mtimes.get(record["path"]) == st.st_mtime_ns:
            known[record["path"]] = record
    return known


def _is_complete(out: Path) -> bool:
    try:
        json.loads((out / INDEX_FILE).read_text())
        return True
    except (OSError, ValueError):
        return False


def _make_ready(out: Path, plan: dict, mtimes: dict[str, int], earlier: dict,
                rebuild: bool) -> bool:
    """Creates `out`, or keeps what it holds of this plan, or, holding an unfinished
    preparation of another (or a finished one, with `rebuild`), deletes the files this
    module writes and nothing else. True when it is complete already."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    existing = [f for f in out.iterdir()]
    if existing and not (out / PLAN_FILE).is_file():
        raise PrepareError(f"--out {out} is not empty and was not made by jaxmoe.data.prepare; "
                           f"choose a new or empty directory")
    complete = _is_complete(out)
    if existing and earlier.get("plan") == plan:
        if complete:
            if earlier.get("mtime_ns") != mtimes:  # touched, not changed: spare the next hash
                _write_json(out / PLAN_FILE, {"plan": plan, "mtime_ns": mtimes})
            return True
        print(f"resuming the preparation in {out}", file=sys.stderr)
    elif existing:
        changes = plan_changes(earlier.get("plan", {}), plan)
        if complete and not rebuild:
            raise PrepareError(f"--out {out} holds a finished preparation of other inputs or "
                               f"options ({changes}); it is kept: pass --rebuild to replace it, "
                               f"or choose another --out")
        print(f"{out}: {'replacing the finished' if complete else 'discarding the unfinished'} "
              f"preparation of other inputs or options ({changes})", file=sys.stderr)
        # the index first: a half-deleted preparation must not read as a finished one
        for f in sorted(existing, key=lambda f: f.name != INDEX_FILE):
            if f.is_file() and OUR_FILES.fullmatch(f.name):
                f.unlink()
    for f in out.glob(f"*{PARTIAL}"):
        if OUR_FILES.fullmatch(f.name):
            f.unlink()
    _write_json(out / PLAN_FILE, {"plan": plan, "mtime_ns": mtimes})
    return False


def prepare(inputs: list[str], out: str | Path, tokenizer_spec: str, *, text_field: str = "text",
            heldout_fraction: float = 0.05, workers: int = 0, unit_mb: float = 64,
            bad_text: str = "refuse", rebuild: bool = False, progress: bool = True) -> dict:
    """Writes the shards and index; returns the index. workers 0: one per CPU; 1: in
    this process."""
    if not inputs:
        raise PrepareError("no inputs given")
    if not 0 <= heldout_fraction <= 0.5:
        raise PrepareError(f"--heldout-fraction must be in [0, 0.5], got {heldout_fraction}")
    if unit_mb <= 0:
        raise PrepareError(f"--unit-mb must be positive, got {unit_mb}")
    if workers < 0:
        raise PrepareError(f"--workers must be 0 (one per CPU) or more, got {workers}")
    if bad_text not in BAD_TEXT:
        raise PrepareError(f"--bad-text must be one of {', '.join(BAD_TEXT)}, got {bad_text!r}")
    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"  # by the largest id
    options = {"text_field": text_field, "heldout_fraction": heldout_fraction, "unit_mb": unit_mb,
               "dtype": dtype, "bad_text": bad_text}
    out = Path(out).expanduser().absolute()
    found, skipped = find_inputs(inputs)
    earlier = _earlier(out)
    inspected = inspect_inputs(found, _known(earlier), progress)
    records = [[r for r, _ in recs] for recs in inspected]
    taken, skipped_text = take(found, records, bad_text)
    skipped += skipped_text
    units = plan_units(taken, max(int(unit_mb * 2**20), 1))
    if not units:
        raise PrepareError(f"no documents: {describe_counts(skipped, 'documents')}")
    t = tokenizer.describe()
    plan = {"inputs": [str(Path(i).expanduser().absolute()) for i in inputs],
            "files": [r for recs in records for r in recs],
            "tokenizer": {k: t[k] for k in ("sha256", "vocab_size", "eos_id", "bos_id")},
            **options}
    mtimes = {r["path"]: mtime for recs in inspected for r, mtime in recs}
    if _make_ready(out, plan, mtimes, earlier, rebuild):
        print(f"{out} already holds this preparation", file=sys.stderr)
        return json.loads((out / INDEX_FILE).read_text())
    itemsize = np.dtype(dtype).itemsize
    done = {}
    for n in range(len(units)):
        record = _recorded(out, n, itemsize)
        if record is not None:
            done[n] = record
    todo = [n for n in range(len(units)) if n not in done]
    args = (text_field, heldout_fraction, dtype, bad_text)
    bar = tqdm(total=len(units), initial=len(done), unit="unit", disable=not progress,
               desc="tokenizing")
    if workers == 1 or len(todo) <= 1:
        _init_worker(str(tokenizer_spec), in_a_pool=False)
        for n in todo:
            done[n] = tokenize_unit(str(out), n, units[n], *args)
            bar.update()
    else:
        workers = workers or os.cpu_count() or 1
        with concurrent.futures.ProcessPoolExecutor(
                min(workers, len(todo)), mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(str(tokenizer_spec),)) as pool:
            futures = {pool.submit(tokenize_unit, str(out), n, units[n], *args): n for n in todo}
            for future in concurrent.futures.as_completed(futures):
                try:
                    done[futures[future]] = future.result()
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)  # now, not after the rest
                    raise
                bar.update()
    bar.close()
    counts = skipped + sum((Counter(done[n].get("counts", {})) for n in done), Counter())
    shards = [s for n in sorted(done) for s in done[n]["shards"] if s["tokens"]]
    totals = {split: {"tokens": sum(s["tokens"] for s in shards if s["split"] == split),
                      "documents": sum(s["documents"] for s in shards if s["split"] == split)}
              for split in ("train", "val")}
    if not totals["train"]["tokens"]:
        raise PrepareError(f"no document went to the train split ({totals['val']['documents']} "
                           f"held out; {describe_counts(counts, 'documents')}); lower "
                           f"--heldout-fraction or add text")
    index = {"format": INDEX_FORMAT, "version": 2, "dtype": dtype,
             "tokenizer": tokenizer.describe(), "text_field": text_field,
             "heldout_fraction": heldout_fraction, "inputs": plan["inputs"], "totals": totals,
             "counts": dict(counts), "shards": shards}
    _write_json(out / INDEX_FILE, index)
    return index


def _recorded(out: Path, number: int, itemsize: int) -> dict | None:
    try:
        record = json.loads((out / f"unit-{number:05d}.json").read_text())
        for s in record["shards"]:
            f = out / s["file"]
            if not f.is_file() or f.stat().st_size != s["tokens"] * itemsize:
                return None
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def build_parser() -> argparse.ArgumentParser:
    """The arguments of `python -m jaxmoe.data.prepare`; docs/reference/commands.md is generated from
    them."""
    parser = argparse.ArgumentParser(prog="python -m jaxmoe.data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="text files, directories, JSON Lines files, "
                        "or saved datasets")
    parser.add_argument("--out", required=True, help="output directory (new, or one to resume)")
    parser.add_argument("--tokenizer", required=True,
                        help="a tokenizer.json, a directory holding one, or 'bytes'")
    parser.add_argument("--text-field", default="text", help="JSON Lines / dataset field (text)")
    parser.add_argument("--heldout-fraction", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=0, help="processes; 0: one per CPU")
    parser.add_argument("--unit-mb", type=float, default=64, help="input MiB per unit of work")
    parser.add_argument("--bad-text", choices=BAD_TEXT, default="refuse",
                        help="text that is not UTF-8 or is binary: refuse (an error naming the "
                             "byte), skip it (counted), or replace its bad bytes with U+FFFD "
                             "(not UTF-8 only; counted)")
    parser.add_argument("--rebuild", action="store_true",
                        help="replace a finished preparation of other inputs or options in --out")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        index = prepare(args.inputs, args.out, args.tokenizer, text_field=args.text_field,
                        heldout_fraction=args.heldout_fraction, workers=args.workers,
                        unit_mb=args.unit_mb, bad_text=args.bad_text, rebuild=args.rebuild,
                        progress=not args.no_progress)
    except (PrepareError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = index["totals"]
    print(f"{t['train']['tokens']:,} train tokens ({t['train']['documents']:,} documents) and "
          f"{t['val']['tokens']:,} held-out tokens ({t['val']['documents']:,} documents) in "
          f"{len(index['shards'])} {index['dtype']} shards; index: "
          f"{Path(args.out).absolute() / INDEX_FILE}")
    print(f"inputs: {describe_counts(index.get('counts', {}), 'documents')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
