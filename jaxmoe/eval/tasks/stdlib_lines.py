"""Docs of jaxmoe's two tasks on Python source: which line comes next?

Each doc is a place in one of the standard library's held-out files (the files
`data.source: stdlib` holds out of training, by the same hash of their path):
the lines before it, whole, up to CONTEXT_BYTES, as the context; as choices the
line that really comes next and `choices - 1` wrong ones, as long in bytes, so
neither the summed nor the length-normalised log-likelihood can pick the real
line by its length. Nothing is downloaded; no doc overlaps the training text.

- `stdlib_next_line` (kind "other_files"): the wrong lines come from other held-out
  files. Telling them apart takes the context: the indentation it calls for, the
  names it binds.
- `stdlib_word_order` (kind "word_order"): the wrong lines are the real one with its
  words in another order. Telling them apart takes Python's syntax, which a small
  model learns early: the default job's accuracy climbs within its 300 steps.

lm-eval calls `dataset(**dataset_kwargs, **metadata)` (a task YAML beside this file
names it as its `custom_dataset`); jaxmoe passes the run's `heldout_fraction` as
metadata, so the docs come from that run's held-out files.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from jaxmoe.data.corpus import stdlib_files

CONTEXT_BYTES = 56  # the lines before the place, whole, up to this many bytes
LINE_BYTES = (8, 64)  # a line's length without its indentation (at least), and with it (at most)
KINDS = ("other_files", "word_order")


def _eligible(line: str) -> bool:
    n = len(line.encode("utf-8"))
    return LINE_BYTES[0] <= len(line.strip().encode("utf-8")) and n <= LINE_BYTES[1]


def _places(lines: list[str]) -> list[tuple[str, str]]:
    """(context, next line) of each place in a file whose next line is eligible and
    whose line before it is not blank."""
    out = []
    for i in range(1, len(lines)):
        if not _eligible(lines[i]) or not lines[i - 1].strip():
            continue
        context, j = "", i
        while j > 0 and len((lines[j - 1] + "\n" + context).encode("utf-8")) <= CONTEXT_BYTES:
            context = lines[j - 1] + "\n" + context
            j -= 1
        if context.strip():
            out.append((context, lines[i] + "\n"))
    return out


def _reordered(line: str, wanted: int, rng: np.random.Generator) -> list[str]:
    """Up to `wanted` distinct lines of `line`'s words (split at single spaces after
    the indentation) in other orders."""
    body = line.rstrip("\n")
    indent = len(body) - len(body.lstrip(" "))
    words = body[indent:].split(" ")
    out: list[str] = []
    for _ in range(20 * wanted):
        other = " " * indent + " ".join(words[i] for i in rng.permutation(len(words))) + "\n"
        if other != line and other not in out:
            out.append(other)
            if len(out) == wanted:
                break
    return out


def _same_length(places, by_length, f: int, line: str, wanted: int, rng) -> list[str]:
    """`wanted` lines of files other than f, as long as `line` in bytes (the nearest
    lengths when too few are), in a seeded order."""
    length = len(line.encode("utf-8"))
    out: list[str] = []
    for d in sorted(by_length, key=lambda m: (abs(m - length), m)):
        pool = [places[k][2] for k in rng.permutation(by_length[d]) if places[k][0] != f]
        out += [o for o in dict.fromkeys(pool) if o != line and o not in out]
        if len(out) >= wanted:
            return out[:wanted]
    return out


def docs(kind: str = "other_files", heldout_fraction: float = 0.05, examples: int = 1000,
         choices: int = 4, seed: int = 0, root: str | None = None) -> list[dict]:
    """`examples` docs {context, choices, gold, file}; the same for the same arguments."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {list(KINDS)}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    _, heldout = stdlib_files(str(root), heldout_fraction)
    places = [(f, context, line) for f, rel in enumerate(heldout) for context, line in
              _places((root / rel).read_text("utf-8", errors="replace").splitlines())]
    by_length: dict[int, list[int]] = {}
    for n, (_, _, line) in enumerate(places):
        by_length.setdefault(len(line.encode("utf-8")), []).append(n)
    rng = np.random.default_rng(seed)
    out = []
    for n in rng.permutation(len(places)):
        f, context, line = places[n]
        if kind == "word_order":
            wrong = _reordered(line, choices - 1, rng)
        else:
            wrong = _same_length(places, by_length, f, line, choices - 1, rng)
        if len(wrong) < choices - 1:  # too few words (or lines) to make the choices of
            continue
        options = [line] + wrong
        order = rng.permutation(choices)
        out.append({"context": context, "choices": [options[i] for i in order],
                    "gold": int(np.argmin(order)), "file": heldout[f]})
        if len(out) == examples:
            return out
    if not out:
        raise ValueError(f"{kind}: no place in the held-out files of {root} "
                         f"(heldout_fraction={heldout_fraction}) has {choices} choices")
    return out


def dataset(kind: str = "other_files", heldout_fraction: float = 0.05, examples: int = 1000,
            choices: int = 4, seed: int = 0, **_metadata):
    """lm-eval's `custom_dataset`: {"test": a `datasets.Dataset` of `docs`}."""
    import datasets

    return {"test": datasets.Dataset.from_list(docs(kind, heldout_fraction, examples, choices,
                                                    seed))}
