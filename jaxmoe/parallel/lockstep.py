"""Interleaved 1F1B as one SPMD program runs it: a schedule in lockstep, and its tables.

In one SPMD program the stages advance together. Each iteration, a stage runs at
most one chunk's forward and one chunk's backward. Then a collective-permute each
way hands activations to the next stage and cotangents to the previous one, so a
hand-on takes an iteration in either direction. The forward of a micro-batch's last
chunk and its backward may share an iteration: the last stage computes the loss
between them.

Chunk c = v S + s runs on stage s in round v (W rounds, `StageStack`'s order). Each
stage issues its forwards in Megatron's interleaved order (micro-batches in groups
of S, a group's rounds in turn), while it holds fewer than `cap` chunk inputs, and
each iteration runs the oldest backward whose cotangent has arrived. With the
smallest cap that costs nothing, a stage holds (S - 1) 2 + (W - 1) S + 1 chunk
inputs, whatever the micro-batch count M (a multiple of S where W > 1): Megatron's
warm-up count, plus one.
GPipe-class schedules hold all M W (`benchmarks/pipeline_schedules.py` compares
the two).

`tables` turns a schedule into per-(iteration, stage) integer arrays: what each
stage runs, and which slots of its ring (held inputs) and mailboxes (arrivals not
yet used) each op reads and writes. Slots are reused from the iteration after they
are freed.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Schedule(NamedTuple):
    stages: int  # S
    virtual: int  # W
    microbatches: int  # M
    forward: dict  # (micro-batch, chunk) -> the iteration of its forward
    backward: dict  # and of its backward
    held: int  # the most chunk inputs one stage holds at once

    @property
    def iterations(self) -> int:
        return max(self.backward.values()) + 1

    def cost(self, backward: float = 2.0) -> float:
        """Each iteration at its busiest stage's work, in chunk forwards (a stage
        skips the ops it does not run)."""
        work = np.zeros((self.iterations, self.stages))
        for ops, price in ((self.forward, 1.0), (self.backward, backward)):
            for (m, c), t in ops.items():
                work[t, c % self.stages] += price
        return float(work.max(axis=1).sum())


class Deadlock(ValueError):
    """Every stage holds `cap` inputs and waits on a forward it cannot run."""


def warmup_held(stages: int, virtual: int) -> int:
    """The chunk inputs a stage holds under `schedule`'s default cap."""
    return (stages - 1) * 2 + (virtual - 1) * stages + 1


def schedule(stages: int, virtual: int, microbatches: int, cap: int | None = None) -> Schedule:
    """The lockstep interleaved 1F1B schedule of M micro-batches over S stages of W
    chunks each, holding at most `cap` chunk inputs a stage (by default Megatron's
    warm-up count plus one, capped at M W)."""
    S, W, M = stages, virtual, microbatches
    if W > 1 and M % S:  # a group's rounds in turn: otherwise a partial group stalls them
        raise ValueError(f"interleaved 1F1B over {S} stages needs a multiple of {S} "
                         f"micro-batches, not {M}")
    C = S * W
    cap = min(warmup_held(S, W), M * W) if cap is None else cap
    order = sorted(((m, v) for m in range(M) for v in range(W)),
                   key=lambda mv: (mv[0] // S, mv[1], mv[0] % S))
    issued = [0] * S
    fwd, bwd = {}, {}
    pending = [[] for _ in range(S)]  # each stage's held inputs: (forward iteration, m, c)
    held = t = 0
    while len(bwd) < M * C:
        busy = False
        for s in range(S):
            if issued[s] < len(order) and len(pending[s]) < cap:
                m, v = order[issued[s]]
                c = v * S + s
                if c == 0 or fwd.get((m, c - 1), t) < t:
                    fwd[(m, c)] = t
                    issued[s] += 1
                    pending[s].append((t, m, c))
                    busy = True
        held = max([held] + [len(p) for p in pending])
        for s in range(S):
            ready = [(since, m, c) for since, m, c in pending[s]
                     if (c == C - 1 and since <= t) or bwd.get((m, c + 1), t) < t]
            if ready:
                oldest = min(ready)
                bwd[oldest[1:]] = t
                pending[s].remove(oldest)
                busy = True
        t += 1
        if not busy:  # nothing ran, so nothing is on its way
            raise Deadlock(f"1F1B over {S} stages of {W} chunks, {M} micro-batches, at most "
                           f"{cap} held a stage, deadlocks")
    out = Schedule(S, W, M, fwd, bwd, held)
    check(out)
    return out


def check(sch: Schedule) -> None:
    """Raises AssertionError unless `sch` keeps the lockstep rules: every op once,
    after its input (or cotangent) arrived, one of each kind per stage and
    iteration, and `held` the most inputs any stage holds."""
    S, C = sch.stages, sch.stages * sch.virtual
    every = {(m, c) for m in range(sch.microbatches) for c in range(C)}
    assert set(sch.forward) == every == set(sch.backward), "an op missing or extra"
    for (m, c), t in sch.forward.items():
        assert c == 0 or sch.forward[(m, c - 1)] < t, f"forward of {(m, c)} before its input"
        after = sch.forward[(m, c)] if c == C - 1 else sch.backward[(m, c + 1)] + 1
        assert sch.backward[(m, c)] >= after, f"backward of {(m, c)} before its cotangent"
    for ops in (sch.forward, sch.backward):
        slots = [(t, c % S) for (m, c), t in ops.items()]
        assert len(slots) == len(set(slots)), "two ops of one kind on a stage at once"
    count = np.zeros((sch.iterations + 1, S), int)
    for key, t in sch.forward.items():  # held from its forward through its backward
        count[t, key[1] % S] += 1
        count[sch.backward[key] + 1, key[1] % S] -= 1
    assert count.cumsum(axis=0).max() == sch.held, "held miscounted"


class Tables(NamedTuple):
    """[T, S] int32 arrays: at iteration t, stage s ..."""

    f_on: np.ndarray  # runs a forward
    f_micro: np.ndarray  # of this micro-batch
    f_round: np.ndarray  # through its chunk of this round
    f_first: np.ndarray  # the model's first chunk: reads the pass's input
    f_last: np.ndarray  # the model's last chunk: only files its input
    f_mail: np.ndarray  # otherwise reads its input from this mailbox slot
    f_ring: np.ndarray  # and keeps it in this ring slot
    b_on: np.ndarray  # runs a backward
    b_micro: np.ndarray
    b_round: np.ndarray
    b_first: np.ndarray  # the first chunk: its input cotangent is the pass's
    b_last: np.ndarray  # the last chunk: its cotangent is the loss's
    b_mail: np.ndarray  # otherwise its cotangent is in this mailbox slot
    b_ring: np.ndarray  # its input in this ring slot
    in_f: np.ndarray  # an activation arrives (sent last iteration) ...
    in_f_slot: np.ndarray  # ... into this mailbox slot
    in_b: np.ndarray  # a cotangent arrives ...
    in_b_slot: np.ndarray
    sizes: tuple  # (ring, activation mailbox, cotangent mailbox) slots a stage needs


def tables(sch: Schedule) -> Tables:
    S, C, T = sch.stages, sch.stages * sch.virtual, sch.iterations
    names = [f for f in Tables._fields if f != "sizes"]
    tab = {k: np.zeros((T, S), np.int32) for k in names}
    ring, fmail, bmail = ([{} for _ in range(S)] for _ in range(3))
    size = {"ring": 0, "f": 0, "b": 0}
    fwd_at, bwd_at = {}, {}
    for (m, c), t in sch.forward.items():
        fwd_at.setdefault(t, []).append((m, c))
    for (m, c), t in sch.backward.items():
        bwd_at.setdefault(t, []).append((m, c))

    def take(slots: dict, key, kind: str) -> int:
        used = set(slots.values())
        slot = next(i for i in range(len(used) + 1) if i not in used)
        slots[key] = slot
        size[kind] = max(size[kind], slot + 1)
        return slot

    def put(t, s, **row):
        for k, v in row.items():
            tab[k][t, s] = v

    for t in range(T):
        freed = []
        for m, c in fwd_at.get(t - 1, []):
            if c + 1 < C:
                s = (c + 1) % S
                put(t, s, in_f=1, in_f_slot=take(fmail[s], (m, c + 1), "f"))
        for m, c in bwd_at.get(t - 1, []):
            if c > 0:
                s = (c - 1) % S
                put(t, s, in_b=1, in_b_slot=take(bmail[s], (m, c - 1), "b"))
        for m, c in fwd_at.get(t, []):
            s = c % S
            put(t, s, f_on=1, f_micro=m, f_round=c // S, f_first=c == 0, f_last=c == C - 1,
                f_mail=fmail[s][(m, c)] if c > 0 else 0, f_ring=take(ring[s], (m, c), "ring"))
            if c > 0:
                freed.append((fmail[s], (m, c)))
        for m, c in bwd_at.get(t, []):
            s = c % S
            put(t, s, b_on=1, b_micro=m, b_round=c // S, b_first=c == 0, b_last=c == C - 1,
                b_mail=bmail[s][(m, c)] if c < C - 1 else 0, b_ring=ring[s][(m, c)])
            freed.append((ring[s], (m, c)))
            if c < C - 1:
                freed.append((bmail[s], (m, c)))
        for slots, key in freed:  # reusable from the next iteration
            del slots[key]
    return Tables(**tab, sizes=(size["ring"], size["f"], size["b"]))
