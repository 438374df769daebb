"""The starts of a run and the steps each ran: a torchrun restart, a resume from a checkpoint,
a new run from a loaded state.

A run's events (one rank's, the lowest that wrote a ``start``) are cut at its ``start``
events. Each start begins at its ``start`` event's step (0, or the step a ``resume=True``
checkpoint restored), or at the step of a state it loaded later (a ``state_loaded`` event,
``guard.load_state_dict``); it reached
the highest step its events and metrics lines name (a checked step ``s`` counts as reached
``s + 1``). A restart without a resume runs its steps again from 0; a killed start whose
metrics lines were lost still counts to its last event (a checkpoint, a skip).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainguard.report.readers import float_of, int_of

CHECKED = ("nonfinite", "spike", "skip", "overflow", "dropped")
"""Events of a step that was checked: the start reached the step after it."""


@dataclass
class Start:
    begin: int
    """The step it started at."""
    end: int
    """The step it reached after its last rollback (the next step it would have checked)."""
    again: int = 0
    """Steps its rollbacks ran again (from the restored step through the failing one)."""

    @property
    def steps(self) -> int:
        """The steps it ran, those run again after a rollback counted again."""
        return max(self.end - self.begin, 0) + self.again


def is_start(event: dict[str, Any]) -> bool:
    """A ``start`` event that begins a start: not a guard taking over from another in the
    same process (an optimizer made anew under ``trainguard run``: its start carries
    ``handover``), which goes on with the start before it."""
    return event.get("kind") == "start" and not event.get("handover")


def run_starts(events: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[Start]:
    """The run's starts in time order: one for a log written before runs had ``start``
    events (it began at step 0), none for an empty run."""
    ranks = [int_of(e.get("rank")) for e in events if e["kind"] == "start"]
    ranks = ranks or [int_of(e.get("rank")) for e in events]
    own = [e for e in events if int_of(e.get("rank")) == min(ranks)] if ranks else []
    cuts = [i for i, e in enumerate(own) if is_start(e)]
    if not cuts:
        return [_start(own, records, -math.inf, math.inf, 0)] if own or records else []
    out = []
    for first, after in zip(cuts, [*cuts[1:], len(own)], strict=True):
        inside = own[first:after]  # its ``start`` first: written once a resume restored the
        # state, so its step is where the start began (the ``resume`` event comes before it)
        t1 = _time(own[after]) if after < len(own) else math.inf
        out.append(_start(inside, records, _time(inside[0]), t1, int_of(inside[0].get("step"))))
    return out


def _start(
    inside: list[dict[str, Any]],
    records: list[dict[str, Any]],
    t0: float,
    t1: float,
    begin: int,
) -> Start:
    """The start of the events ``inside`` and the metrics lines from ``t0`` to ``t1``."""
    for e in inside:
        if e["kind"] == "state_loaded":  # guard.load_state_dict: the loop's own checkpoint
            begin = int_of(e.get("step"))
    rollbacks = [e for e in inside if e["kind"] == "rollback" and "restored_step" in e]
    again = sum(int_of(e.get("step")) + 1 - int_of(e.get("restored_step")) for e in rollbacks)
    since = max((_time(e) for e in rollbacks), default=t0)  # the steps after the last one
    reached = [begin, *(int_of(e.get("restored_step")) for e in rollbacks[-1:])]
    for e in inside:
        if e["kind"] in ("resume", "state_loaded", "rollback") or _time(e) < since:
            continue
        reached.append(int_of(e.get("step")) + (1 if e["kind"] in CHECKED else 0))
    reached += [int_of(r.get("step")) + 1 for r in records if since <= _time(r) < t1]
    return Start(begin, max(reached), again)


def _time(item: dict[str, Any]) -> float:
    return float_of(item.get("time"))
