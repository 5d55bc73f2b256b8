"""Detectors for token gerrymandering, over the logged load metrics
(`jaxmoe.model.load_metrics`): `gerrymandering` (the Switch loss falls while the load
worsens) and `steady_gerrymandering` (the loss reads as balanced while the load is
not). The loss is one plus a covariance of loads and scores, not a distance from
uniform load, so it can improve while the real load gets worse.
"""

from __future__ import annotations

# Thresholds of the two checks, on the logged per-MoE-layer figures (`load_metrics`).
# A pattern must hold over this many logged steps (the falling kind compares the means
# of two such windows): one noisy step is not a trend.
WINDOW = 5
# Steady kind: its pattern must also span this many training steps, first logged step
# to last, so that a run logged every step is not flagged on a passing phase.
STEADY_STEPS = 40
# Falling kind: the least relative fall of the loss and rise of the load between windows.
FALL = 0.02
# Steady kind: a loss at most this above 1 (or below 1) reads as balanced. Were the
# scores to follow the loads, the excess would be the load's squared coefficient of
# variation, and 0.1 would allow at most ~9% of the experts dead.
LOSS_BAND = 0.1
# Far from balanced, any of: max/mean load this high (balanced demo runs sit at 2-3.5,
# count noise alone at ~3 when experts average 4 tokens);
MAX_OVER_MEAN = 4.0
# this share of the experts without a token (chance empties one averaging 4 tokens
# with probability e^-4 < 2%);
DEAD_FRACTION = 0.25
# this many nats below log E: the load as spread as fewer than e^-0.5 = 61% of the
# experts used evenly.
ENTROPY_DEFICIT = 0.5
# The steady check ignores the router's early collapse: the first 50 steps (the demo
# runs that go on to balance collapse over steps 10-50, benchmarks/RESULTS.md), or the
# first tenth of a long run, whose longer warmup settles later.
SETTLE_STEPS = 50
SETTLE_FRACTION = 0.1


def settle_step(total_steps: int) -> int:
    """The last step the steady-state check ignores."""
    return max(SETTLE_STEPS, int(SETTLE_FRACTION * total_steps))


def _num_experts(record: dict) -> int:
    return len(record["expert_load"]) // len(record["load_max_over_mean"])


def _layer_figures(record: dict, layer: int) -> str:
    return (f"balance loss {record['balance_loss_layer'][layer]:.3f}, max/mean load "
            f"{record['load_max_over_mean'][layer]:.2f}, {int(record['dead_experts'][layer])} "
            f"of {_num_experts(record)} experts dead, entropy deficit "
            f"{record['entropy_deficit'][layer]:.2f} nats")


def gerrymandering(records: list[dict], window: int = WINDOW,
                   min_change: float = FALL) -> tuple[int, str] | None:
    """Flags a balance loss that falls while the true max/mean load rises.

    records: the logged training records, oldest first. Compares the mean balance
    loss (over MoE layers) and the worst layer's max/mean load over the last
    `window` records with the `window` before. Returns (MoE layer, message), the
    layer being the worst one now, or None.
    """
    if len(records) < 2 * window:
        return None
    history = [(r["balance_loss"], max(r["load_max_over_mean"])) for r in records[-2 * window:]]
    before, after = history[:window], history[window:]
    loss0, load0 = (sum(x) / window for x in zip(*before))
    loss1, load1 = (sum(x) / window for x in zip(*after))
    if loss1 < loss0 * (1 - min_change) and load1 > load0 * (1 + min_change):
        last = records[-1]
        load_Lm = last["load_max_over_mean"]
        layer = max(range(len(load_Lm)), key=lambda i: load_Lm[i])
        return layer, (f"gerrymandering: balance loss fell {loss0:.3f} -> {loss1:.3f} while "
                       f"max/mean expert load rose {load0:.2f} -> {load1:.2f}; at step "
                       f"{last['step']} MoE layer {layer} has {_layer_figures(last, layer)}")
    return None


def _far_from_balanced(record: dict, layer: int) -> bool:
    """The layer's loss reads as balanced while its load is not."""
    return (record["balance_loss_layer"][layer] <= 1.0 + LOSS_BAND
            and (record["load_max_over_mean"][layer] >= MAX_OVER_MEAN
                 or record["dead_experts"][layer] >= DEAD_FRACTION * _num_experts(record)
                 or record["entropy_deficit"][layer] >= ENTROPY_DEFICIT))


def recent_history(records: list[dict]) -> list[dict]:
    """The tail of the logged records that both checks need: the last 2 * WINDOW, and
    enough to span STEADY_STEPS (from the last record at or before that many steps
    back, whatever the logging interval)."""
    last = records[-1]["step"]
    start = max((i for i, r in enumerate(records) if r["step"] <= last - STEADY_STEPS), default=0)
    return records[max(0, min(start, len(records) - 2 * WINDOW)):]


def steady_gerrymandering(records: list[dict], settle: int) -> tuple[int, str] | None:
    """Flags a layer whose balance loss reads as balanced while its load is not.

    records: the logged training records, oldest first. Fires when one MoE layer's
    own balance loss is within LOSS_BAND of its balanced 1.0 (or below) while its
    load is past MAX_OVER_MEAN, DEAD_FRACTION of its experts dead or ENTROPY_DEFICIT,
    in each of the latest records after step `settle`, at least WINDOW of them
    spanning at least STEADY_STEPS steps. Returns (MoE layer, message) for the first
    such layer, or None.
    """
    for layer in range(len(records[-1]["load_max_over_mean"])):
        streak = []  # the layer's latest run of such records, newest first
        for r in reversed(records):
            if r["step"] <= settle or not _far_from_balanced(r, layer):
                break
            streak.append(r)
        if len(streak) >= WINDOW and streak[0]["step"] - streak[-1]["step"] >= STEADY_STEPS:
            return layer, _steady_message(streak[::-1], layer)
    return None


def _steady_message(streak: list[dict], layer: int) -> str:
    def span(key, fmt):  # the layer's range over the streak
        values = [r[key][layer] for r in streak]
        return f"{min(values):{fmt}}-{max(values):{fmt}}"
    return (f"gerrymandering: MoE layer {layer}'s balance loss sits near its balanced 1.0 "
            f"({span('balance_loss_layer', '.3f')}) over steps {streak[0]['step']}-"
            f"{streak[-1]['step']} while its load is far from balanced: max/mean "
            f"{span('load_max_over_mean', '.2f')}, {span('dead_experts', '.0f')} of "
            f"{_num_experts(streak[-1])} experts dead, entropy deficit "
            f"{span('entropy_deficit', '.2f')} nats")
