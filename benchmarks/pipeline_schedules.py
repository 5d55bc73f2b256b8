"""Pipeline schedules in one SPMD program, counted: time and activation memory.

    python benchmarks/pipeline_schedules.py [--backward 2] [--rows NAME ...]

One SPMD program runs its stages in lockstep: every iteration each stage runs at
most one chunk's forward and one chunk's backward, then hands activations to the
next stage and cotangents to the previous one (a collective-permute each way), so
a hand-on takes an iteration in either direction. The forward of a micro-batch's
last chunk and its backward may share an iteration (the last stage computes the
loss between them). Within those rules this script schedules, for each anchor row
(S stages, W chunks per stage, M micro-batches a pass, A accumulation passes):

- circular: jaxmoe's schedule. Each pass runs W M + S - 1 forward iterations, all
  stages computing (masked where they hold no micro-batch), then their backward
  (autodiff of the loop); a stage keeps all M W of its chunk activations.
- 1F1B: one pass over all A M micro-batches, each stage issuing forwards in
  Megatron's interleaved order (groups of S micro-batches, a group's chunks round
  by round) while at most K chunk activations are held, and the oldest ready
  backward every iteration. Priced two ways: masked (every iteration costs a
  forward and a backward on every stage, as jnp.where computes both) and skipped
  (an iteration costs its busiest stage's work, as a lax.cond on the stage's
  own schedule would; the stage's collectives only span devices of one stage).

Costs are in units of one chunk's forward (--backward: a backward's cost; 2 without
recomputation, 3 recomputing everything). Prints each schedule's step cost relative
to circular's and the chunk activations its busiest stage holds.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

ROWS = {  # the anchor configs' pipelines: (S, W, M, A)
    "olmocore_large_296b_512xb300": (4, 2, 8, 4),
    "olmocore_ultra_1200b_512xb300": (8, 4, 16, 8),
    "deepseek_v3_256xb300": (8, 2, 16, 8),
    "deepseek_v3_256xgb300": (2, 8, 8, 4),
}


@dataclass
class Schedule:
    iterations: int
    masked: float  # cost with every stage computing both ops every iteration
    skipped: float  # cost with each iteration its busiest stage's work
    held: int  # the most chunk activations one stage holds at once
    forward: dict | None = None  # (micro-batch, chunk) -> the iteration of its forward
    backward: dict | None = None  # and of its backward


def circular(S: int, W: int, M: int, A: int, backward: float) -> Schedule:
    steps = W * M + S - 1
    cost = A * steps * (1 + backward)
    return Schedule(2 * A * steps, cost, cost, M * W)


def one_f_one_b(S: int, W: int, M: int, cap: int, backward: float) -> Schedule:
    """Lockstep 1F1B over M micro-batches (one pass), at most `cap` held a stage."""
    C = S * W  # chunks; chunk c = v S + s runs on stage s in round v
    order = sorted(((m, v) for m in range(M) for v in range(W)),
                   key=lambda mv: (mv[0] // S, mv[1], mv[0] % S))
    nxt = [0] * S
    fwd, bwd = {}, {}  # (m, c) -> iteration
    pending = [[] for _ in range(S)]  # each stage's held (forward iteration, m, c)
    peak = t = idle = 0
    masked = skipped = 0.0
    while len(bwd) < M * C:
        busy = [0.0] * S
        for s in range(S):
            if nxt[s] < len(order) and len(pending[s]) < cap:
                m, v = order[nxt[s]]
                c = v * S + s
                if c == 0 or fwd.get((m, c - 1), t) < t:
                    fwd[(m, c)] = t
                    nxt[s] += 1
                    pending[s].append((t, m, c))
                    busy[s] += 1
        peak = max([peak] + [len(p) for p in pending])
        for s in range(S):
            ready = [e for e in pending[s] if (e[2] == C - 1 and e[0] <= t)
                     or bwd.get((e[1], e[2] + 1), t) < t]
            if ready:
                oldest = min(ready)
                bwd[oldest[1:]] = t
                pending[s].remove(oldest)
                busy[s] += backward
        masked += 1 + backward
        skipped += max(busy)
        t += 1
        idle = idle + 1 if max(busy) == 0 else 0
        if idle > 1:  # deadlocked: every stage full, waiting on a forward it cannot run
            return Schedule(t, float("inf"), float("inf"), peak)
    _check(S, C, fwd, bwd, peak)
    return Schedule(t, masked, skipped, peak, fwd, bwd)


def _check(S: int, C: int, fwd: dict, bwd: dict, peak: int) -> None:
    """The schedule keeps the lockstep rules, counted again from its iterations."""
    for (m, c), t in fwd.items():
        assert c == 0 or fwd[(m, c - 1)] < t, ("forward before its input", m, c)
        assert bwd[(m, c)] >= t if c == C - 1 else bwd[(m, c + 1)] < bwd[(m, c)], (
            "backward before its cotangent", m, c)
    for ops in (fwd, bwd):
        per_iteration = [(t, c % S) for (m, c), t in ops.items()]
        assert len(per_iteration) == len(set(per_iteration)), "two ops of a kind at once"
    last = max(bwd.values())
    most = max(sum(fwd[k] <= t <= bwd[k] for k in fwd if k[1] % S == s)
               for t in range(last + 1) for s in range(S))
    assert most == peak, (most, peak)


def fewest_held(S: int, W: int, M: int, backward: float, within: float = 1.01,
                most: int | None = None) -> Schedule:
    """The schedule with the smallest cap whose cost is within `within` of the
    uncapped schedule's (or, with `most`, the cheapest holding at most that many)."""
    if most is not None:
        return one_f_one_b(S, W, M, most, backward)
    best = one_f_one_b(S, W, M, M * W, backward).skipped
    lo, hi = 1, M * W  # the cost does not rise with the cap
    while lo < hi:
        mid = (lo + hi) // 2
        if one_f_one_b(S, W, M, mid, backward).skipped <= within * best:
            hi = mid
        else:
            lo = mid + 1
    return one_f_one_b(S, W, M, lo, backward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backward", type=float, default=2.0)
    parser.add_argument("--rows", nargs="*", default=list(ROWS))
    args = parser.parse_args()
    print("| row (S, W, M, A) | schedule | held a stage | iterations | step, masked | "
          "step, skipped |")
    print("|---|---|---|---|---|---|")
    for name in args.rows:
        S, W, M, A = ROWS[name]
        base = circular(S, W, M, A, args.backward)

        def line(what, sch):
            print(f"| {name} ({S}, {W}, {M}, {A}) | {what} | {sch.held} | {sch.iterations} | "
                  f"{sch.masked / base.masked:.3f} | {sch.skipped / base.skipped:.3f} |")

        line("circular (jaxmoe)", base)
        for passes in (A, 1):  # 1F1B per accumulation pass, or one pass over them all
            n = M * A // passes
            label = f"1F1B, {passes} pass{'es' if passes > 1 else ''} of {n}"
            r = fewest_held(S, W, n, args.backward)
            line(label, Schedule(r.iterations * passes, r.masked * passes, r.skipped * passes,
                                 r.held))
            if r.held > M * W:  # the same memory as circular's
                q = fewest_held(S, W, n, args.backward, most=M * W)
                line(label + ", held as circular's", Schedule(
                    q.iterations * passes, q.masked * passes, q.skipped * passes, q.held))

if __name__ == "__main__":
    main()
