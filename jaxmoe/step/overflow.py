"""What a step does when its routed tokens overflow the expert buffers (`moe.on_overflow`).

Expert buffers hold `moe.capacity_factor` x each expert's uniform share of rows: the
common case, and the size every step compiles for. A step whose routing asks for more
has its copies past the buffers dropped and counted (`drop`), or, with `rerun`, its
update is not applied (the step computes the overflow on device and leaves the state
as it was) and the same batch runs again at the next capacity of a short ladder
(double, up to E / K, which holds every copy), each compiled once, when first needed.
Later steps start at the capacity that last held a step, and step back down the
ladder after `PATIENCE` steps in a row that overflowed nothing: a run whose routing
needs more than the configured buffers reruns a step when its need grows, not every
step. `raise` stops the run with the demand it saw. `rerun` and `raise` read one flag per step on the host: a wait for the step's
end before the next is dispatched.
"""

from __future__ import annotations

import dataclasses

from jaxmoe.config import Config
from jaxmoe.step.build import Steps, build_steps


# steps in a row without an overflow before the next step tries a smaller capacity
PATIENCE = 50


class Overflow(RuntimeError):
    """A step's routed copies overflowed its expert buffers (`moe.on_overflow: raise`)."""


def ladder(cfg: Config) -> list[float]:
    """The capacity factors a step may run at: the configured one, doubled until E / K
    (dropless), E / K last."""
    top = cfg.moe.num_experts / cfg.moe.top_k
    factors = [cfg.moe.capacity_factor]
    while factors[-1] < top:
        factors.append(min(2 * factors[-1], top))
    return factors


class OverflowSteps:
    """`steps.train_step` under `moe.on_overflow`, with the steps of larger buffers
    compiled on first need."""

    def __init__(self, steps: Steps):
        self.base, self.mode = steps, steps.cfg.moe.on_overflow
        self.factors = ladder(steps.cfg)
        self.by_factor = {self.factors[0]: steps}
        self.rung = 0  # where the next step starts on the ladder
        self.clean = 0  # steps in a row since the last overflow
        self.reruns = 0  # steps run again, over the run
        self.overflows = 0  # steps whose first run overflowed

    def _steps(self, factor: float) -> Steps:
        if factor not in self.by_factor:
            cfg = self.base.cfg
            cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=factor))
            self.by_factor[factor] = build_steps(cfg, self.base.mesh)
        return self.by_factor[factor]

    def __call__(self, state, batch):
        """(state, metrics) of one training step on `batch`; with `rerun`, the step's
        metrics are those of the run that held every copy, plus `capacity_factor` (that
        run's) and the run's counts so far: `overflowed_steps` (steps whose first run
        overflowed) and `reruns`."""
        if self.mode == "drop" or not self.base.cfg.num_moe_layers:
            return self.base.train_step(state, batch)
        state, metrics = self._steps(self.factors[self.rung]).train_step(state, batch)
        if int(metrics["overflowed"]):
            self.overflows += 1
            self.clean = 0
            if self.mode == "raise":
                raise Overflow(
                    f"step {int(state.step) + 1}: up to "
                    f"{float(metrics['drop_fraction'].max()):.1%} of a layer's routed copies "
                    f"found no room in expert buffers of moe.capacity_factor="
                    f"{self.factors[0]:g} (the busiest expert got "
                    f"{float(metrics['load_max_over_mean'].max()):.2f}x its uniform share of "
                    "the batch); moe.on_overflow: rerun runs such a step again with larger "
                    f"buffers, up to E / K = {self.factors[-1]:g}, which holds every copy")
            while int(metrics["overflowed"]):  # E / K, the last rung, never overflows
                self.rung += 1
                self.reruns += 1
                state, metrics = self._steps(self.factors[self.rung]).train_step(state, batch)
        else:
            self.clean += 1
            if self.rung and self.clean >= PATIENCE:
                self.rung, self.clean = self.rung - 1, 0
        return state, {**metrics, "capacity_factor": self.factors[self.rung],
                       "overflowed_steps": self.overflows, "reruns": self.reruns}
