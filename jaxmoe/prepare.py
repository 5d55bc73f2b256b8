"""python -m jaxmoe.prepare INPUT... --tokenizer TOKENIZER --out DIR

Tokenizes a corpus into flat token shards for `data.source: tokens`. Inputs are
text files (one document each), directories of them (.txt, .md, .py, and .jsonl
files), JSON Lines files (`.jsonl`, `.json`, optionally `.gz`; one document per
line, in the field `--text-field`), or a Hugging Face `datasets` dataset saved
with `save_to_disk` (one document per row). Every document is followed by one EOS; a document goes to
the held-out split when a hash of its text says so (`--heldout-fraction`), so
duplicates always land on the same side.

The work is cut into units of about `--unit-mb` of input, tokenized by parallel
worker processes. Unit u writes `train-u.bin` and `val-u.bin` (little-endian
uint16 when the vocabulary fits, else uint32) under temporary names, renames them
when complete, and records them in `unit-u.json` last; `index.json`, which the
loader reads, is written when every unit is done. Interrupted, a second run with
the same inputs and options resumes from the units already recorded; with other
inputs or options it starts clean.
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
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxmoe.data import INDEX_FILE, INDEX_FORMAT, TEXT_SUFFIXES, walk_files
from jaxmoe.tokenizer import Tokenizer, TokenizerError, load_tokenizer

PLAN_FILE = "prepare.json"
PARTIAL = ".partial"
JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
DIRECTORY_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".jsonl.gz")  # a .json in a tree may be anything
DATASET_MARKERS = ("dataset_info.json", "state.json")  # what save_to_disk writes
ROWS_PER_UNIT = 20_000  # dataset rows per unit


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


def plan_units(inputs: list[str], unit_bytes: int) -> list[Unit]:
    """The inputs cut into units, in a fixed order (a pure function of the inputs)."""
    units: list[Unit] = []
    texts: list[tuple[str, int]] = []
    for raw in inputs:
        p = Path(raw).expanduser().absolute()
        if not p.exists():
            raise PrepareError(f"input {raw} does not exist")
        if (p / "dataset_dict.json").is_file():
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
            raise PrepareError(f"input {raw} is a DatasetDict; name one split's directory "
                               f"(one of: {', '.join(str(p / s) for s in splits)})")
        if _is_dataset(p):
            rows = _dataset(str(p), "").num_rows
            units += [Unit("dataset", (str(p),), a, min(a + ROWS_PER_UNIT, rows))
                      for a in range(0, rows, ROWS_PER_UNIT)]
            continue
        if p.is_dir():
            files = [p / rel for rel in walk_files(p, DIRECTORY_SUFFIXES)]
            if not files:
                raise PrepareError(f"input directory {raw} holds no "
                                   f"{'/'.join(DIRECTORY_SUFFIXES)} files")
        else:
            files = [p]
        for f in files:
            size = f.stat().st_size
            if f.name.endswith(JSONL_SUFFIXES):
                if f.name.endswith(".gz") or size <= unit_bytes:
                    units.append(Unit("jsonl", (str(f),), 0, -1))
                else:
                    units += [Unit("jsonl", (str(f),), a, min(a + unit_bytes, size))
                              for a in range(0, size, unit_bytes)]
            else:
                texts.append((str(f), size))
    group, group_bytes = [], 0
    for f, size in texts:  # small text files share a unit
        if group and group_bytes + size > unit_bytes:
            units.append(Unit("text", tuple(group)))
            group, group_bytes = [], 0
        group.append(f)
        group_bytes += size
    if group:
        units.append(Unit("text", tuple(group)))
    if not units:
        raise PrepareError("no documents: the inputs are empty")
    return units


def plan_id(inputs: list[str], units: list[Unit], tokenizer: Tokenizer, options: dict) -> dict:
    """What a run's output depends on (the files it reads, their sizes and times, the
    tokenizer's contents, the options): a resumed run must match it exactly."""
    read = []
    for unit in units:
        for p in map(Path, unit.paths):
            for f in sorted(p.rglob("*")) if p.is_dir() else [p]:  # a dataset's files
                if f.is_file():
                    st = f.stat()
                    read.append([str(f), st.st_size, st.st_mtime_ns])
    digest = hashlib.sha256(json.dumps(sorted(read)).encode()).hexdigest()
    t = tokenizer.describe()
    return {"inputs": [str(Path(i).expanduser().absolute()) for i in inputs], "files_sha256": digest,
            "tokenizer": {k: t[k] for k in ("sha256", "vocab_size", "eos_id", "bos_id")},
            **options}


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
    """(where, line) of the lines that start in [start, stop); bytes that are not
    UTF-8 are replaced, as in text files."""
    if path.endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                yield f"line {number}", line
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
            yield f"byte {at}", line.decode("utf-8", errors="replace")


def documents(unit: Unit, text_field: str):
    """The unit's documents, as strings."""
    if unit.kind == "text":
        for f in unit.paths:
            yield Path(f).read_bytes().decode("utf-8", errors="replace")
    elif unit.kind == "jsonl":
        path = unit.paths[0]
        for where, line in _jsonl_lines(path, unit.start, unit.stop):
            if not line.strip():
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
    else:
        ds = _dataset(unit.paths[0], text_field)
        for text in ds.select(range(unit.start, unit.stop))[text_field]:
            if not isinstance(text, str):
                raise PrepareError(f"dataset {unit.paths[0]}: column {text_field!r} holds "
                                   f"{type(text).__name__}, not text")
            yield text


def is_heldout(text: str, fraction: float) -> bool:
    return zlib.crc32(text.encode("utf-8", errors="replace")) < fraction * 2**32


# ---------------------------------------------------------------- one unit

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_spec: str, in_a_pool: bool = True) -> None:
    global _worker_tokenizer
    if in_a_pool:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_tokenizer = load_tokenizer(tokenizer_spec)


def _write(path: Path, tokens: np.ndarray) -> None:
    partial = path.with_name(path.name + PARTIAL)
    with open(partial, "wb") as f:
        tokens.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def tokenize_unit(out: str, number: int, unit: Unit, text_field: str, heldout_fraction: float,
                  dtype: str, batch: int = 256) -> dict:
    """Tokenizes one unit into its two shards and records it; returns the record."""
    tokenizer = _worker_tokenizer
    np_dtype = np.dtype(dtype).newbyteorder("<")
    parts = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    texts: list[str] = []

    def tokenize_pending():
        for text, ids in zip(texts, tokenizer.encode_documents(texts)):
            split = "val" if is_heldout(text, heldout_fraction) else "train"
            parts[split].append(np.asarray(ids, np_dtype))
            counts[split] += 1
        texts.clear()

    for text in documents(unit, text_field):
        texts.append(text)
        if len(texts) >= batch:
            tokenize_pending()
    tokenize_pending()
    record = {"unit": number, "shards": []}
    for split in ("train", "val"):
        tokens = np.concatenate(parts[split]) if parts[split] else np.zeros(0, np_dtype)
        name = f"{split}-{number:05d}.bin"
        _write(Path(out) / name, tokens)
        record["shards"].append({"file": name, "split": split, "tokens": int(len(tokens)),
                                 "documents": counts[split],
                                 "max_id": int(tokens.max()) if len(tokens) else -1})
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


OUR_FILES = re.compile(rf"((train|val)-\d{{5}}\.bin|unit-\d{{5}}\.json|{re.escape(INDEX_FILE)}"
                       rf"|{re.escape(PLAN_FILE)})({re.escape(PARTIAL)})?")


def _make_ready(out: Path, plan: dict) -> bool:
    """Creates `out`, or keeps what it holds of this plan, or (another plan) deletes the
    files this module writes and nothing else. True when it is complete already."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    existing = [f for f in out.iterdir()]
    if existing and not (out / PLAN_FILE).is_file():
        raise PrepareError(f"--out {out} is not empty and was not made by jaxmoe.prepare; "
                           f"choose a new or empty directory")
    if existing:
        try:
            old = json.loads((out / PLAN_FILE).read_text())
        except ValueError:
            old = None
        if old == plan:
            try:
                json.loads((out / INDEX_FILE).read_text())
                return True
            except (OSError, ValueError):
                print(f"resuming the preparation in {out}", file=sys.stderr)
        else:
            print(f"{out} holds a preparation of other inputs, input files or options: "
                  f"starting clean", file=sys.stderr)
            for f in existing:
                if f.is_file() and OUR_FILES.fullmatch(f.name):
                    f.unlink()
    for f in out.glob(f"*{PARTIAL}"):
        if OUR_FILES.fullmatch(f.name):
            f.unlink()
    _write_json(out / PLAN_FILE, plan)
    return False


def prepare(inputs: list[str], out: str | Path, tokenizer_spec: str, *, text_field: str = "text",
            heldout_fraction: float = 0.05, workers: int = 0, unit_mb: float = 64,
            progress: bool = True) -> dict:
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
    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"  # by the largest id
    options = {"text_field": text_field, "heldout_fraction": heldout_fraction, "unit_mb": unit_mb,
               "dtype": dtype}
    out = Path(out).expanduser().absolute()
    units = plan_units(inputs, max(int(unit_mb * 2**20), 1))
    plan = plan_id(inputs, units, tokenizer, options)
    if _make_ready(out, plan):
        print(f"{out} already holds this preparation", file=sys.stderr)
        return json.loads((out / INDEX_FILE).read_text())
    itemsize = np.dtype(dtype).itemsize
    records = {}
    for n in range(len(units)):
        record = _recorded(out, n, itemsize)
        if record is not None:
            records[n] = record
    todo = [n for n in range(len(units)) if n not in records]
    args = (text_field, heldout_fraction, dtype)
    bar = tqdm(total=len(units), initial=len(records), unit="unit", disable=not progress,
               desc="tokenizing")
    if workers == 1 or len(todo) <= 1:
        _init_worker(str(tokenizer_spec), in_a_pool=False)
        for n in todo:
            records[n] = tokenize_unit(str(out), n, units[n], *args)
            bar.update()
    else:
        workers = workers or os.cpu_count() or 1
        with concurrent.futures.ProcessPoolExecutor(
                min(workers, len(todo)), mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(str(tokenizer_spec),)) as pool:
            futures = {pool.submit(tokenize_unit, str(out), n, units[n], *args): n for n in todo}
            for future in concurrent.futures.as_completed(futures):
                try:
                    records[futures[future]] = future.result()
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)  # now, not after the rest
                    raise
                bar.update()
    bar.close()
    shards = [s for n in sorted(records) for s in records[n]["shards"] if s["tokens"]]
    totals = {split: {"tokens": sum(s["tokens"] for s in shards if s["split"] == split),
                      "documents": sum(s["documents"] for s in shards if s["split"] == split)}
              for split in ("train", "val")}
    if not totals["train"]["tokens"]:
        raise PrepareError("every document went to the held-out split; lower --heldout-fraction")
    index = {"format": INDEX_FORMAT, "version": 1, "dtype": dtype,
             "tokenizer": tokenizer.describe(), "text_field": text_field,
             "heldout_fraction": heldout_fraction, "inputs": plan["inputs"], "totals": totals,
             "shards": shards}
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxmoe.prepare", description=__doc__,
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
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        index = prepare(args.inputs, args.out, args.tokenizer, text_field=args.text_field,
                        heldout_fraction=args.heldout_fraction, workers=args.workers,
                        unit_mb=args.unit_mb, progress=not args.no_progress)
    except (PrepareError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = index["totals"]
    print(f"{t['train']['tokens']:,} train tokens ({t['train']['documents']:,} documents) and "
          f"{t['val']['tokens']:,} held-out tokens ({t['val']['documents']:,} documents) in "
          f"{len(index['shards'])} {index['dtype']} shards; index: "
          f"{Path(args.out).absolute() / INDEX_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
