"""Pipeline schedules in one SPMD program, counted: time and activation memory.

    python benchmarks/pipeline_schedules.py [--backward 2] [--rows NAME ...]

One SPMD program runs its stages in lockstep (`jaxmoe.parallel.lockstep`: a
hand-on takes an iteration in either direction). For each anchor row (S stages, W
chunks per stage, M micro-batches a pass, A accumulation passes) this prices:

- circular: jaxmoe's schedule. Each pass runs W M + S - 1 forward iterations, all
  stages computing (masked where they hold no micro-batch), then their backward
  (autodiff of the loop); a stage keeps all M W of its chunk inputs.
- 1F1B: `lockstep.schedule`, per accumulation pass or in one pass over all A M
  micro-batches, at the smallest cap on the chunk inputs a stage holds whose cost
  is within 1% of the uncapped one's. Priced two ways: masked (every iteration
  costs a forward and a backward on every stage, as jnp.where computes both) and
  skipped (an iteration costs its busiest stage's work, as a lax.cond on the
  stage's own schedule does: `jaxmoe.parallel.one_f_one_b`).

Costs are in units of one chunk's forward (--backward: a backward's cost; 2 without
recomputation, 3 recomputing everything). Prints each schedule's step cost relative
to circular's and the chunk activations its busiest stage holds.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxmoe.parallel import lockstep  # noqa: E402

ROWS = {  # the anchor configs' pipelines: (S, W, M, A)
    "olmocore_large_296b_512xb300": (4, 2, 8, 4),
    "olmocore_ultra_1200b_512xb300": (8, 4, 16, 8),
    "deepseek_v3_256xb300": (8, 2, 16, 8),
    "deepseek_v3_256xgb300": (2, 8, 8, 4),
}


@dataclass
class Priced:
    iterations: int
    masked: float  # cost with every stage computing both ops every iteration
    skipped: float  # cost with each iteration its busiest stage's work
    held: int  # the most chunk inputs one stage holds at once


def circular(S: int, W: int, M: int, A: int, backward: float) -> Priced:
    steps = W * M + S - 1
    cost = A * steps * (1 + backward)
    return Priced(2 * A * steps, cost, cost, M * W)


def one_f_one_b(S: int, W: int, M: int, cap: int, backward: float) -> Priced:
    try:
        sch = lockstep.schedule(S, W, M, cap)
    except lockstep.Deadlock:
        return Priced(0, float("inf"), float("inf"), cap)
    return Priced(sch.iterations, sch.iterations * (1 + backward), sch.cost(backward), sch.held)


def fewest_held(S: int, W: int, M: int, backward: float, within: float = 1.01) -> Priced:
    """The schedule with the smallest cap whose cost is within `within` of the
    uncapped schedule's."""
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
            r = fewest_held(S, W, n, args.backward)
            line(f"1F1B, {passes} pass{'es' if passes > 1 else ''} of {n}",
                 Priced(r.iterations * passes, r.masked * passes, r.skipped * passes, r.held))


if __name__ == "__main__":
    main()
