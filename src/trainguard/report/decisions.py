"""The ``decisions`` line: how many steps run were ok, and how many each bad decision took.

The bad steps are counted from their events: a non-finite step by its ``nonfinite`` event's
``action`` (``skip``, ``warn``, ``escalate``...), a GradScaler overflow by its ``overflow``
event, a spike the rule skipped or escalated by its ``spike`` events (one per judged step).
``ok`` is the steps run (``report/starts.py``: every start's, those run again counted again)
minus them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def decision_counts(
    nonfinite: list[dict[str, Any]],
    overflows: int,
    spikes: list[dict[str, Any]],
    steps_run: int,
    steps: int,
) -> dict[str, int]:
    """``{"ok": n, "skip": n, ...}`` from the merged events (``ok`` first, the rest sorted);
    with no step reached (``steps``), the bad ones only."""
    bad: Counter[str] = Counter(str(e.get("action") or "?") for e in nonfinite)
    if overflows:
        bad["overflow"] += overflows
    bad.update(spike_actions(spikes))
    ok = max(steps_run - sum(bad.values()), 0)
    return {"ok": ok, **dict(sorted(bad.items()))} if steps else dict(bad)


def spike_actions(spikes: list[dict[str, Any]]) -> Counter[str]:
    """Steps a spike skipped (``spike``) or escalated, one per judged step: the loss's and the
    gradient norm's events of a step are one judgment (a metric seen again at the same step
    is the step run again after a rollback)."""
    actions: Counter[str] = Counter()
    step, metrics = None, set()
    for event in spikes:  # merged, in (step, time) order
        metric = event.get("metric")
        if event.get("step") == step and metric not in metrics:
            metrics.add(metric)
            continue
        step, metrics = event.get("step"), {metric}
        action = event.get("action")
        if action in ("spike", "escalate"):  # "warn": applied, an ok step
            actions[str(action)] += 1
    return actions
