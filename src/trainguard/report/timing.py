"""Per-rank timing of a run: the metrics log's data and compute seconds, the straggler spans.

The metrics log holds, per logged step, every rank's seconds waiting for its data and in its
own forward (``data_times``, ``compute_times``; past 64 ranks a ``time_summary`` per phase:
``median``, ``max``, ``max_rank``). The table is each rank's median over the logged steps;
a large world gets, per phase, the median of the steps' medians and the ranks most often the
slowest. ``straggler`` events become spans (rank, first step, end step, phase) for the picture.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.events import number

PHASES = ("data", "compute")


@dataclass(frozen=True)
class StepTimes:
    """One logged step's per-rank seconds (or, past 64 ranks, its per-phase summary)."""

    data: list[float] | None = None
    compute: list[float] | None = None
    summary: dict[str, Any] | None = None


def step_times(record: dict[str, Any]) -> StepTimes | None:
    """The times of a metrics line, or None when the step was not timed."""
    data, compute = _floats(record.get("data_times")), _floats(record.get("compute_times"))
    if data is not None and compute is not None and len(data) == len(compute):
        return StepTimes(data=data, compute=compute)
    summary = record.get("time_summary")
    return StepTimes(summary=summary) if isinstance(summary, dict) else None


def rank_table(times: Sequence[StepTimes]) -> list[dict[str, Any]]:
    """Per rank: the median data and compute seconds over the steps that list every rank, and
    whether any of them timed a fetch (``data_seen``: a fetch of under a microsecond is 0 in
    the log, and a loop without ``watch()`` logs 0 at every step)."""
    listed = [t for t in times if t.data is not None and t.compute is not None]
    if not listed:
        return []
    world = max(len(t.data or []) for t in listed)
    full = [t for t in listed if len(t.data or []) == world]
    return [
        {
            "rank": rank,
            "data": statistics.median((t.data or [])[rank] for t in full),
            "compute": statistics.median((t.compute or [])[rank] for t in full),
            "data_seen": any((t.data or [])[rank] > 0 for t in full),
            "steps": len(full),
        }
        for rank in range(world)
    ]


def phase_summary(times: Sequence[StepTimes], top: int = 3) -> dict[str, Any]:
    """Past 64 ranks, per phase: the median of the steps' medians and the ranks most often the
    slowest (``[rank, steps]``)."""
    out: dict[str, Any] = {}
    for phase in PHASES:
        found = [t.summary.get(phase) for t in times if t.summary is not None]
        parts: list[dict[str, Any]] = [p for p in found if isinstance(p, dict)]
        medians = [m for p in parts if (m := number(p.get("median"))) is not None]
        slowest = Counter(p["max_rank"] for p in parts if isinstance(p.get("max_rank"), int))
        if medians:
            out[phase] = {
                "median": statistics.median(medians),
                "slowest_ranks": [[r, n] for r, n in slowest.most_common(top)],
                "steps": len(parts),
            }
    return out


def straggler_spans(events: Sequence[dict[str, Any]], end: int) -> list[tuple[int, int, int, str]]:
    """``(rank, from step, to step, phase)`` for each rank named by a ``straggler`` event, until
    the phase's next verdict (or ``end``, the run's step count)."""
    spans = []
    for phase in PHASES:
        verdicts = [e for e in events if e.get("phase") == phase and isinstance(e.get("step"), int)]
        for i, event in enumerate(verdicts):
            last = i + 1 == len(verdicts)
            stop = max(end, event["step"] + 1) if last else verdicts[i + 1]["step"]
            for rank in event.get("ranks") or []:
                if isinstance(rank, int):
                    spans.append((rank, event["step"], stop, phase))
    return spans


def _floats(value: Any) -> list[float] | None:
    if not isinstance(value, list):
        return None
    floats = [number(v) for v in value]
    return None if any(v is None for v in floats) else [v for v in floats if v is not None]
