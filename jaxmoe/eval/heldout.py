"""The held-out loss, of the whole corpus and of each source of a mixture.

Each source's held-out tokens give a fixed set of `train.eval_batches` batches of
windows (`heldout_batches`), scored through the training program at its training
capacity (`Steps.eval_step`). Logged: `eval_ce` (nats per token) and `eval_bpb`
(bits per byte of the text the targets stand for: a byte-level model's ids are
bytes, a tokenizer's are decoded, special tokens counting none; left out when the
tokenizer does not describe the ids, as for raw shards read with `bytes`). With
several sources, each has its own `eval_ce/<source>` and `eval_bpb/<source>`; the
totals are the mixture's: `eval_ce` the sources' losses weighted as the mixture
weighs them, `eval_bpb` their weighted nats over their weighted bytes.
"""

from __future__ import annotations

import glob
import math
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from jaxmoe.data.batches import heldout_batches
from jaxmoe.data.corpus import Corpus
from jaxmoe.data.tokenizer import BYTE_VOCAB, Tokenizer
from jaxmoe.parallel.sharding import from_whole


@dataclass(frozen=True)
class HeldoutSet:
    label: str | None  # the source's name in metric keys; None: the corpus has one source
    weight: float  # the source's mixture weight
    batches: tuple[np.ndarray, ...]  # int32 [B, L1]: every row of each batch
    text_bytes: int | None  # UTF-8 bytes of the text the targets stand for; None: unknown


def source_labels(names: list[str]) -> list[str]:
    """Short names of sources for metric keys: the last part of each path that is not
    a glob pattern, without a shard suffix; repeats get _2, _3, ..."""
    labels = []
    for name in names:
        parts = [p for p in Path(name).parts if not glob.has_magic(p)] or [name]
        label = Path(parts[-1]).stem if Path(parts[-1]).suffix in (".npy", ".bin") else parts[-1]
        n, unique = 1, label
        while unique in labels:
            n += 1
            unique = f"{label}_{n}"
        labels.append(unique)
    return labels


def heldout_sets(corpus: Corpus, tokenizer: Tokenizer, batch_size: int, seq_len: int,
                 num_batches: int) -> tuple[list[HeldoutSet], list[str]]:
    """The sets to evaluate, and the sources too short for a window of seq_len + 1
    held-out tokens (left out, named)."""
    sources = corpus.heldout_sources
    labels = source_labels([s.name for s in sources]) if len(sources) > 1 else [None]
    sets, skipped = [], []
    for source, label in zip(sources, labels):
        if max((len(s) for s in source.shards), default=0) < seq_len + 1:
            skipped.append(source.name)
            continue
        batches = tuple(heldout_batches(source.shards, batch_size, seq_len, num_batches))
        if tokenizer.is_bytes and max(int(b.max()) for b in batches) >= BYTE_VOCAB:
            text = None  # ids a byte-level tokenizer does not cover: no text to count
        else:
            text = sum(tokenizer.text_bytes(row[1:]) for b in batches for row in b)
        sets.append(HeldoutSet(label, source.weight, batches, text))
    return sets, skipped


def nats(steps, state, batches) -> float:
    """The negative log-likelihood of every target of the batches (whole, int32
    [B, L1] each), summed: through the training program at its training capacity."""
    put = lambda rows: from_whole(rows, steps.batch_sharding)  # noqa: E731
    mask = put(np.ones(np.shape(batches[0][:, 1:]), bool))
    logprob = [steps.eval_step(state.params, state.buffers, put(np.asarray(b)), mask)["logprob"]
               for b in batches]
    return -float(np.sum(jax.device_get(logprob), dtype=np.float64))


def evaluate(steps, state, sets: list[HeldoutSet]) -> dict[str, float]:
    """eval_ce and eval_bpb (and each source's) of the state's parameters."""
    results, per_target = {}, []  # (weight, nats, text bytes) per target of each source
    for s in sets:
        targets = sum(b[:, 1:].size for b in s.batches)
        ce = nats(steps, state, s.batches) / targets
        text = None if s.text_bytes is None else s.text_bytes / targets
        suffix = "" if s.label is None else f"/{s.label}"
        results[f"eval_ce{suffix}"] = ce
        if text:
            results[f"eval_bpb{suffix}"] = ce / math.log(2) / text
        per_target.append((s.weight, ce, text))
    if len(sets) > 1:
        weight, ce, text = zip(*per_target)
        w = np.asarray(weight, np.float64) / sum(weight)
        results["eval_ce"] = float(w @ np.asarray(ce))
        if all(text):
            results["eval_bpb"] = float(w @ np.asarray(ce) / math.log(2) / (w @ np.asarray(text)))
    return results
