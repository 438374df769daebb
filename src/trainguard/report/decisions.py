"""The ``decisions`` line: how many steps run were ok, and how many each bad decision took.

The bad steps are counted from their events: a non-finite step by its ``nonfinite`` event's
``action`` (``skip``, ``warn``, ``escalate``...), a GradScaler overflow by its ``overflow``
event, a step a rank's loop left out itself (``trainguard run``) by its ``dropped`` event, a
spike the rule skipped or escalated by its ``spike`` events (one per judged step).
``ok`` is the steps run (``report/starts.py``: every start's, those run again counted again)
minus them. A run without readable events (``events/`` missing or unreadable) is counted
from its metrics log's ``decision`` field instead (``metric_decisions``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

NOT_NONFINITE = ("ok", "spike", "overflow", "dropped")
"""Decisions of a step that was not a non-finite one, whatever its gradient norm."""


def decision_counts(
    nonfinite: list[dict[str, Any]],
    others: dict[str, int],
    spikes: list[dict[str, Any]],
    steps_run: int,
    steps: int,
) -> dict[str, int]:
    """``{"ok": n, "skip": n, ...}`` from the merged events (``ok`` first, the rest sorted);
    with no step reached (``steps``), the bad ones only. ``others``: the steps neither ok nor
    bad by their own events' count (``overflow``, ``dropped``)."""
    bad: Counter[str] = Counter(str(e.get("action") or "?") for e in nonfinite)
    bad.update({kind: count for kind, count in others.items() if count})
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


class MetricPoint(Protocol):
    """A metrics log line as the report reads it (``summary.StepPoint``)."""

    step: int
    grad_norm: float | None
    decision: str
    bad_ranks: list[int]


def metric_nonfinite(points: Sequence[MetricPoint]) -> list[dict[str, Any]]:
    """The non-finite steps the metrics log shows (a run without readable events): a step
    whose decision is not ``ok`` and whose loss on a rank, or gradient norm, is not finite."""
    found = []
    for point in points:
        norm = point.grad_norm
        grad_bad = norm is None or not math.isfinite(norm)
        if point.decision in NOT_NONFINITE or not (point.bad_ranks or grad_bad):
            continue
        where = "loss" if point.bad_ranks else "grad"
        found.append(
            {
                "step": point.step,
                "where": where,
                "ranks": point.bad_ranks or None,
                "action": point.decision,
                "params": None,
            }
        )
    return found


def metric_decisions(points: Sequence[MetricPoint], steps_run: int, steps: int) -> dict[str, int]:
    """``decision_counts`` from the metrics log's ``decision`` field (no readable events):
    every line not ``ok`` is a bad step (the log keeps every one of them, however thinned)."""
    bad = [{"action": p.decision} for p in points if p.decision != "ok"]
    return decision_counts(bad, {}, [], steps_run, steps)
