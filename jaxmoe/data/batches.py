"""Training batches in epochs: every window once per epoch, in a seeded order.

A source's shards are cut into windows of seq_len + 1 tokens that tile each shard
without overlap (a shard's last partial window is not used; the target that would
join two windows, one in seq_len + 1, is the price of no token being read twice). Epoch e of a source
visits its N windows in the order of a seeded permutation of [0, N) -- a Feistel
network, so no N-long array is held and a trillion-token corpus costs nothing to
shuffle. With several sources, each period of MIX_PERIOD consecutive samples
gives source s a fixed quota of round(MIX_PERIOD x weight_s) slots, placed by a
seeded shuffle; each source then walks its own epochs.

Sample g of the run (row r of step t is g = t x batch_size + r) is a pure
function of (seed, g), so resuming is only a step number, and every process reads
just its own rows.

Shapes: B global batch rows, b this process's rows, L1 = seq_len + 1.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxmoe.data.corpus import DataError, Source

MIX_PERIOD = 4096  # samples per mixing period; weights hold to 1/MIX_PERIOD
_ROUNDS = 6  # Feistel rounds: enough for orders that look random to training
_MIX_SALT = 0x6D6978  # separates the mixing draws from the window orders


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijective scramble of uint64 values."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> np.uint64:
    h = np.zeros(1, np.uint64)
    with np.errstate(over="ignore"):
        for p in parts:
            h = _mix64(h + np.uint64(p % (1 << 64)) + np.uint64(0x9E3779B97F4A7C15))
    return h[0]


def permute(index: np.ndarray, n: int, key: int | np.uint64) -> np.ndarray:
    """A seeded bijection of [0, n) applied to `index`: a balanced Feistel network on
    the smallest even bit width covering n, cycle-walked back into range."""
    index = np.asarray(index, np.uint64)
    if n <= 1:
        return np.zeros_like(index)
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    round_keys = [_key(int(key), r) for r in range(_ROUNDS)]

    def encrypt(x):
        left, right = x >> np.uint64(half), x & mask
        for k in round_keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    out = encrypt(index)
    outside = out >= n
    while outside.any():  # the domain is under 4n, so this ends within a few rounds
        out[outside] = encrypt(out[outside])
        outside = out >= n
    return out


@dataclass(frozen=True)
class _Windows:
    """A source's windows: shard i holds windows [starts[i], starts[i+1])."""
    shards: tuple[np.ndarray, ...]
    starts: np.ndarray
    window: int  # L1

    @classmethod
    def of(cls, shards: Sequence[np.ndarray], window: int) -> _Windows:
        counts = [len(s) // window for s in shards]
        return cls(tuple(shards), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                   window)

    @property
    def count(self) -> int:
        return int(self.starts[-1])

    def read(self, windows: np.ndarray) -> np.ndarray:
        """int32 [len(windows), L1]: the tokens of each window."""
        shard_of = np.searchsorted(self.starts, windows, side="right") - 1
        out = np.empty((len(windows), self.window), np.int32)
        for row, (w, s) in enumerate(zip(windows, shard_of)):
            offset = int(w - self.starts[s]) * self.window
            out[row] = self.shards[s][offset:offset + self.window]
        return out


def quotas(weights: Sequence[float], period: int = MIX_PERIOD) -> np.ndarray:
    """Slots per period for each source: largest remainders of period x weight, every
    source at least one."""
    w = np.asarray(weights, np.float64)
    exact = period * w / w.sum()
    q = np.maximum(np.floor(exact).astype(np.int64), 1)
    while q.sum() > period:  # only from sources above their floor of one
        q[np.argmax(np.where(q > 1, q - exact, -np.inf))] -= 1
    order = np.argsort(-(exact - q), kind="stable")
    q[order[:period - q.sum()]] += 1
    return q


def _rows_per_process(batch_size: int, process_index: int, process_count: int) -> int:
    if batch_size < 1 or process_count < 1 or batch_size % process_count:
        raise DataError(f"batch_size {batch_size} must be a positive multiple of "
                        f"process_count {process_count}")
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} not in [0, {process_count})")
    return batch_size // process_count


def _as_sources(train) -> tuple[Source, ...]:
    if isinstance(train, np.ndarray):
        return (Source("tokens", (train,)),)
    train = tuple(train)
    if train and all(isinstance(s, Source) for s in train):
        return train
    if train and all(isinstance(s, np.ndarray) for s in train):
        return (Source("tokens", train),)
    raise DataError("training tokens: expected a 1-D array, a list of shards (arrays) or a list "
                    "of Sources")


class BatchIterator:
    """Deterministic, resumable stream of fixed-shape training batches.

    `train`: a 1-D token array, a list of shards, or a list of `Source`s (a mixture,
    by their weights). Batch `step` is a pure function of (train, seed, step).
    """

    def __init__(self, train, batch_size: int, seq_len: int, seed: int,
                 process_index: int = 0, process_count: int = 1, start_step: int = 0):
        if seed < 0 or start_step < 0:
            raise DataError(f"seed and start_step must be >= 0, got seed={seed}, "
                            f"start_step={start_step}")
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        self.rows = _rows_per_process(batch_size, process_index, process_count)
        self.sources = _as_sources(train)
        self.windows = [_Windows.of(s.shards, seq_len + 1) for s in self.sources]
        for source, w in zip(self.sources, self.windows):
            if w.count == 0:
                longest = max((len(s) for s in source.shards), default=0)
                raise DataError(f"source {source.name}: no shard holds seq_len+1 = {seq_len + 1} "
                                f"tokens (longest: {longest}); use shorter sequences or more data")
        if len(self.sources) > MIX_PERIOD:
            raise DataError(f"{len(self.sources)} sources: at most {MIX_PERIOD} can be mixed")
        self.quota_per_source = quotas([s.weight for s in self.sources])
        weights = np.array([s.weight for s in self.sources])
        for source, w, share in zip(self.sources, self.windows, weights / weights.sum()):
            rows = int(np.ceil(batch_size * share))
            if w.count < rows:
                raise DataError(f"source {source.name} has {w.count} windows of seq_len+1 = "
                                f"{seq_len + 1} tokens, fewer than its {rows} rows of one batch; "
                                f"use more data, shorter sequences or a smaller batch")
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.process_index = process_index
        self.step = start_step
        self._periods: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _period(self, period: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot, how many earlier slots of the period went to that source)."""
        if period in self._periods:
            return self._periods[period]
        if len(self._periods) > 4:
            self._periods.clear()
        labels = np.repeat(np.arange(len(self.sources)), self.quota_per_source)
        labels = np.random.default_rng([self.seed, _MIX_SALT, period]).permutation(labels)
        one_hot = labels[:, None] == np.arange(len(self.sources))
        before = (np.cumsum(one_hot, axis=0) - one_hot)[np.arange(len(labels)), labels]
        self._periods[period] = labels, before
        return labels, before

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, the source's own sample number) of each global sample number."""
        samples = np.asarray(samples, np.int64)
        if len(self.sources) == 1:
            return np.zeros_like(samples), samples
        period, slot = np.divmod(samples, MIX_PERIOD)
        source = np.empty_like(samples)
        own = np.empty_like(samples)
        for p in np.unique(period):
            at = period == p
            labels, before = self._period(int(p))
            source[at] = labels[slot[at]]
            own[at] = p * self.quota_per_source[source[at]] + before[slot[at]]
        return source, own

    def window_of(self, source: int, own: np.ndarray) -> np.ndarray:
        """The window a source reads for its own sample numbers: epoch by epoch."""
        n = self.windows[source].count
        epoch, at = np.divmod(np.asarray(own, np.int64), n)
        out = np.empty_like(at)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = permute(at[sel], n, _key(self.seed, source, int(e))).astype(np.int64)
        return out

    def batch_at(self, step: int) -> np.ndarray:
        """int32 [b, seq_len + 1]: this process's rows of batch `step`."""
        first = step * self.batch_size + self.process_index * self.rows
        source, own = self.assign(np.arange(first, first + self.rows))
        out = np.empty((self.rows, self.seq_len + 1), np.int32)
        for s in np.unique(source):
            at = source == s
            out[at] = self.windows[s].read(self.window_of(int(s), own[at]))
        return out

    def progress(self, steps: int) -> dict[str, float]:
        """After `steps` steps: `epoch`, the most passes any source has made (fractional),
        and `seen`, the fraction of all training windows read at least once."""
        done = steps * self.batch_size
        if len(self.sources) == 1:
            used = np.array([done])
        else:
            full, rest = divmod(done, MIX_PERIOD)
            labels, _ = self._period(full)
            used = full * self.quota_per_source + np.bincount(labels[:rest], minlength=len(self.sources))
        counts = np.array([w.count for w in self.windows])
        return {"epoch": float(np.max(used / counts)),
                "seen": float(np.minimum(used, counts).sum() / counts.sum())}

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> np.ndarray:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state(self) -> dict:
        return {"step": self.step, "seed": self.seed}

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc) -> None:
        pass


class Prefetcher:
    """Prepares the next `depth` batches of a BatchIterator in a background thread
    (reading memory-mapped shards waits on the disk); yields them in order."""

    def __init__(self, batches: BatchIterator, depth: int):
        self.batches, self.step = batches, batches.step
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, daemon=True, name="jaxmoe-prefetch")
        self._thread.start()

    def _fill(self) -> None:
        step = self.step
        while not self._stop.is_set():
            try:
                item = self.batches.batch_at(step)
            except Exception as e:  # handed to the consumer, which raises it
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, Exception):
                return
            step += 1

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> np.ndarray:
        while self._error is None:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise DataError(f"the batch-reading thread stopped before step {self.step}")
        else:
            raise self._error
        if isinstance(item, Exception):
            self._error = item
            raise item
        self.step += 1
        return item

    def state(self) -> dict:
        return {"step": self.step, "seed": self.batches.seed}

    def progress(self, steps: int) -> dict[str, float]:
        return self.batches.progress(steps)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def heldout_batches(heldout, batch_size: int, seq_len: int, num_batches: int,
                    process_index: int = 0, process_count: int = 1) -> list[np.ndarray]:
    """Fixed eval set: windows of seq_len+1 at stride seq_len (each token predicted once)
    across the held-out shards, spread evenly over all of them (so every source of a
    mixture is in it), repeated if there are too few."""
    shards = (heldout,) if isinstance(heldout, np.ndarray) else tuple(heldout)
    rows = _rows_per_process(batch_size, process_index, process_count)
    per_shard = [max((len(s) - 1) // seq_len, 0) for s in shards]
    total = sum(per_shard)
    if total == 0:
        raise DataError(f"held-out tokens: need a shard of at least seq_len+1 = {seq_len + 1} "
                        f"tokens, got shards of {[len(s) for s in shards]}")
    starts = np.concatenate([[0], np.cumsum(per_shard)])
    wanted = num_batches * batch_size
    window_n = (np.arange(wanted) * total) // wanted if wanted <= total else np.arange(wanted) % total
    window_L1 = np.arange(seq_len + 1)
    batches = []
    for j in range(num_batches):
        first = j * batch_size + process_index * rows
        windows = window_n[first:first + rows]
        shard_of = np.searchsorted(starts, windows, side="right") - 1
        batch = np.empty((rows, seq_len + 1), np.int32)
        for row, (w, s) in enumerate(zip(windows, shard_of)):
            batch[row] = shards[s][(w - starts[s]) * seq_len + window_L1]
        batches.append(batch)
    return batches
