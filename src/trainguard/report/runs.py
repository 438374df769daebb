"""The runs of a run directory, and which run each thing on disk belongs to.

Every event names its run (``run``: ``trainguard.runs.identity``); events written before runs
had ids are one run, ``legacy``. A capture's manifest names its run too. The files that do
not (the metrics log's lines, hang reports, older manifests) go by time: a run owns the time
from each of its ``start`` events until the next ``start`` of another run (runs in one
directory follow each other; a torchrun restart or a resume continues its run).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from trainguard.report.readers import float_of
from trainguard.report.starts import is_start

LEGACY = "legacy"
"""The run of events that carry no run id (written before runs had ids)."""
ALL = "all"
"""``--run all``: every run, one after another."""


@dataclass
class RunInfo:
    """One run: when it started, how many times a guard started for it, how far it got."""

    id: str
    start: float
    """Unix time of its first event."""
    last: float
    """Unix time of its last event."""
    starts: int
    """Guards started for it on rank 0 (1 + torchrun restarts + resumes)."""
    steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "start": self.start,
            "start_utc": utc(self.start),
            "steps": self.steps,
            "starts": self.starts,
        }


def utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def run_of(event: dict[str, Any]) -> str:
    """The run an event belongs to."""
    run = event.get("run")
    return run if isinstance(run, str) and run else LEGACY


def list_runs(events: Iterable[dict[str, Any]]) -> list[RunInfo]:
    """The runs the events name, oldest first (steps left at 0: the caller counts them)."""
    runs: dict[str, RunInfo] = {}
    for event in events:
        time = _time(event)
        run = run_of(event)
        info = runs.get(run)
        if info is None:
            info = runs[run] = RunInfo(run, time, time, 0)
        info.start, info.last = min(info.start, time), max(info.last, time)
        if is_start(event) and event.get("rank") == 0:
            info.starts += 1
    return sorted(runs.values(), key=lambda r: (r.start, r.id))


def latest(runs: list[RunInfo]) -> RunInfo | None:
    """The run with the newest event (the one a torchrun restart would continue)."""
    return max(runs, key=lambda r: (r.last, r.start), default=None)


class Timeline:
    """Which run owned a moment: the run of the newest ``start`` event at or before it."""

    def __init__(self, events: Iterable[dict[str, Any]], runs: list[RunInfo]) -> None:
        marks = {(_time(e), run_of(e)) for e in events if e.get("kind") == "start"}
        marks |= {(r.start, r.id) for r in runs}  # a run whose start event is lost
        ordered = sorted(marks)
        self._times = [t for t, _ in ordered]
        self._runs = [r for _, r in ordered]

    def run_at(self, time: Any) -> str | None:
        """The run at unix time ``time`` (before the first start: the first run)."""
        if not self._runs or not isinstance(time, (int, float)) or isinstance(time, bool):
            return None
        i = bisect.bisect_right(self._times, float(time)) - 1
        return self._runs[max(i, 0)]


def _time(event: dict[str, Any]) -> float:
    return float_of(event.get("time"))
