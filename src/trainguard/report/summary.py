"""What happened in a run, read from its directory: events, metrics, captures and hangs.

Every rank writes its own events, so per-rank copies of the same event (a non-finite step,
a skip, a spike, a rollback) are merged by kind and step, keeping the lowest rank's. What
cannot be read (a torn last line of a killed run, garbage, an unreadable file) is skipped
and counted in ``RunSummary.skipped``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.report.readers import Skipped, number, read_json, read_jsonl
from trainguard.report.timing import StepTimes, phase_summary, rank_table, step_times

REPLAY_RESULT = "replay.json"
"""A bundle's replay result, written by ``trainguard replay`` next to the manifest."""

_KEY_FIELDS = ("metric", "hang_id", "path", "reason")
_CHECKPOINT_KINDS = ("checkpoint", "checkpoint_good", "checkpoint_damaged", "resume")


@dataclass
class StepPoint:
    """One step of the metrics log, for the timeline."""

    step: int
    loss: float | None
    """The mean of the ranks' losses (non-finite when any rank's is)."""
    grad_norm: float | None
    decision: str
    bad_ranks: list[int]
    """Ranks whose loss was not finite."""
    times: StepTimes | None = None
    """Every rank's data and compute seconds (None: the step was not timed)."""


@dataclass
class RunSummary:
    """The run at a glance; ``to_dict()`` is what ``trainguard report --json`` prints."""

    run_dir: str
    world_size: int | None = None
    steps: int = 0
    decisions: dict[str, int] = field(default_factory=dict)
    first_bad: dict[str, Any] | None = None
    nonfinite: list[dict[str, Any]] = field(default_factory=list)
    captures: list[dict[str, Any]] = field(default_factory=list)
    spikes: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    escalations: list[dict[str, Any]] = field(default_factory=list)
    bad_input: list[dict[str, Any]] = field(default_factory=list)
    hangs: list[dict[str, Any]] = field(default_factory=list)
    uneven_data: list[dict[str, Any]] = field(default_factory=list)
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """``straggler`` events (one copy per step and phase), in step order."""
    reruns: list[dict[str, Any]] = field(default_factory=list)
    """``rerun`` events (a bad step recomputed in place: transient or persistent)."""
    hosts: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per host: ``transient`` and ``persistent`` reruns its ranks were bad in, and whether it
    was named ``suspect`` (1)."""
    timing: list[dict[str, Any]] = field(default_factory=list)
    """Per rank: median ``data`` and ``compute`` seconds over the logged steps."""
    timing_summary: dict[str, Any] = field(default_factory=dict)
    """Past 64 ranks (no per-rank times logged): per phase, the median and slowest ranks."""
    events: int = 0
    points: list[StepPoint] = field(default_factory=list)
    skipped: Skipped = field(default_factory=Skipped)

    @property
    def empty(self) -> bool:
        """Nothing readable: no events, no metrics, no captures, no hangs."""
        return not (self.events or self.points or self.captures or self.hangs)

    def nonfinite_cells(self) -> list[tuple[int, int]]:
        """(rank, step) pairs where a non-finite value appeared (events and metrics)."""
        flagged = [*self.nonfinite, *self.bad_input]
        cells = {(r, _int(e.get("step"))) for e in flagged for r in e.get("ranks") or []}
        cells |= {(r, p.step) for p in self.points for r in p.bad_ranks}
        return sorted(cells)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("points")
        out["metric_steps"] = len(self.points)
        return out


def summarize(run_dir: Path | str) -> RunSummary:
    """Read a run directory (never raises on damaged content; see ``RunSummary.skipped``)."""
    root = Path(run_dir)
    summary = RunSummary(run_dir=str(root))
    events = _read_events(root, summary.skipped)
    summary.events = len(events)
    summary.points = _read_points(root, summary.skipped)
    times = [p.times for p in summary.points if p.times is not None]
    summary.timing, summary.timing_summary = rank_table(times), phase_summary(times)
    _fill_from_events(summary, events)
    summary.captures = _read_captures(root, summary.skipped)
    summary.hangs = _read_hangs(root, summary.skipped) or _hang_events(events)
    summary.steps = _count_steps(events, summary.points)
    summary.decisions = _decisions(summary)
    return summary


def _read_events(root: Path, skipped: Skipped) -> list[dict[str, Any]]:
    records = [
        rec
        for path in sorted((root / "events").glob("*.jsonl"))
        for rec in read_jsonl(path, root, skipped)
        if isinstance(rec.get("kind"), str)
    ]
    return sorted(records, key=lambda r: (_float(r.get("time")), _int(r.get("rank"))))


def _read_points(root: Path, skipped: Skipped) -> list[StepPoint]:
    path = root / "metrics" / "rank-0.jsonl"
    if not path.is_file():
        return []
    points: dict[int, StepPoint] = {}
    for rec in read_jsonl(path, root, skipped):
        step = rec.get("step")
        if not isinstance(step, int):
            skipped.add_lines(str(path.relative_to(root)), 1)
            continue
        loss, bad_ranks = _losses(rec)
        points[step] = StepPoint(  # a resumed run repeats steps: the latest record wins
            step=step,
            loss=loss,
            grad_norm=number(rec.get("grad_norm")),
            decision=str(rec.get("decision", "?")),
            bad_ranks=bad_ranks,
            times=step_times(rec),
        )
    return [points[s] for s in sorted(points)]


def _losses(rec: dict[str, Any]) -> tuple[float | None, list[int]]:
    """The mean loss (non-finite when a rank's is) and the ranks whose loss was not finite."""
    summary = rec.get("loss_summary")
    if isinstance(summary, dict):  # a large world: the log keeps a summary of the losses
        bad = [r for r in summary.get("nonfinite_ranks") or [] if isinstance(r, int)]
        return (math.nan if bad else number(summary.get("mean"))), bad
    losses = [number(v) for v in rec.get("losses") or []]
    bad = [r for r, v in enumerate(losses) if v is None or not math.isfinite(v)]
    finite = [v for v in losses if v is not None]
    return (sum(finite) / len(finite) if finite else None), bad


def _merged(
    events: list[dict[str, Any]], *kinds: str, keys: tuple[str, ...] = _KEY_FIELDS
) -> list[dict[str, Any]]:
    """One copy of each event written by several ranks (the lowest rank's), by step."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for event in sorted(events, key=lambda e: _int(e.get("rank"))):
        if event["kind"] not in kinds:
            continue
        key = (event["kind"], event.get("step"), *(str(event.get(f)) for f in keys))
        seen.setdefault(key, event)
    return sorted(seen.values(), key=lambda e: (_int(e.get("step")), _float(e.get("time"))))


def _fill_from_events(summary: RunSummary, events: list[dict[str, Any]]) -> None:
    start = next((e for e in events if e["kind"] == "start"), None)
    if start is not None and isinstance(start.get("world_size"), int):
        summary.world_size = start["world_size"]
    summary.nonfinite = [
        {k: e.get(k) for k in ("step", "where", "ranks", "action", "params")}
        for e in _merged(events, "nonfinite")
    ]
    summary.first_bad = summary.nonfinite[0] if summary.nonfinite else None
    summary.spikes = _merged(events, "spike")
    summary.rollbacks = _merged(events, "rollback", "rollback_refused")
    summary.checkpoints = _merged(events, *_CHECKPOINT_KINDS)
    summary.escalations = _merged(events, "escalate")
    summary.bad_input = _merged(events, "bad_input")
    summary.uneven_data = _merged(events, "uneven_data")
    summary.stragglers = _merged(events, "straggler", keys=("phase",))
    summary.reruns = _merged(events, "rerun")
    summary.hosts = _host_counts(summary.reruns, _merged(events, "suspect_host"))
    overflow = _merged(events, "overflow")
    summary.decisions = {"overflow": len(overflow)} if overflow else {}


def _read_captures(root: Path, skipped: Skipped) -> list[dict[str, Any]]:
    captures = []
    for folder in sorted((root / "captures").glob("step-*")):
        manifest = read_json(folder / "manifest.json", root, skipped)
        if manifest is None:
            continue
        replayed = (folder / REPLAY_RESULT).is_file()
        result = read_json(folder / REPLAY_RESULT, root, skipped) if replayed else None
        captures.append(
            {
                "step": manifest.get("step"),
                "path": str(folder.relative_to(root)),
                "reason": manifest.get("reason"),
                "trigger": manifest.get("trigger"),
                "ranks": manifest.get("ranks"),
                "history": (folder / "history.json").is_file(),
                "diagnosis": result.get("summary") if result else None,
                "reproduced": result.get("reproduced") if result else None,
            }
        )
    return captures


def _read_hangs(root: Path, skipped: Skipped) -> list[dict[str, Any]]:
    hangs = []
    for path in sorted((root / "hangs").glob("*/report.json")):
        report = read_json(path, root, skipped)
        if report is None:
            continue
        steps = [r.get("step") for r in report.get("ranks") or [] if isinstance(r, dict)]
        known = [s for s in steps if isinstance(s, int)]
        hangs.append(
            {
                "id": report.get("id", path.parent.name),
                "kind": report.get("kind"),
                "culprits": report.get("culprits", []),
                "reason": report.get("reason"),
                "step": min(known) if known else None,
                "time": report.get("time"),
                "path": str(path.parent.relative_to(root)),
            }
        )
    return hangs


def _hang_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hangs known from events only (the report folder is missing or unreadable)."""
    return [
        {
            "id": e.get("hang_id"),
            "kind": e["kind"],
            "culprits": e.get("culprits", []),
            "reason": e.get("reason"),
            "step": e.get("step"),
            "time": e.get("time"),
            "path": None,
        }
        for e in _merged(events, "hang", "peer_failure")
    ]


def _host_counts(
    reruns: list[dict[str, Any]], suspects: list[dict[str, Any]]
) -> dict[str, dict[str, int]]:
    """Reruns per host of the ranks whose first run went bad, and the suspect hosts."""
    counts: dict[str, dict[str, int]] = {}
    for event in reruns:
        verdict = str(event.get("verdict"))
        if verdict not in ("transient", "persistent"):
            continue
        for host in event.get("hosts") or []:
            row = counts.setdefault(str(host), {"transient": 0, "persistent": 0, "suspect": 0})
            row[verdict] += 1
    for event in suspects:
        for host in event.get("hosts") or []:
            row = counts.setdefault(str(host), {"transient": 0, "persistent": 0, "suspect": 0})
            row["suspect"] = 1
    return dict(sorted(counts.items()))


def _count_steps(events: list[dict[str, Any]], points: list[StepPoint]) -> int:
    counts = [_int(e.get("step")) for e in events if e["kind"] == "close"]
    counts += [_int(e.get("step")) + 1 for e in events if e["kind"] in ("nonfinite", "spike")]
    counts += [p.step + 1 for p in points[-1:]]
    counts += [_int(h.get("step")) for h in _hang_events(events)]
    return max(counts, default=0)


def _decisions(summary: RunSummary) -> dict[str, int]:
    bad: Counter[str] = Counter(str(e.get("action") or "?") for e in summary.nonfinite)
    bad.update(summary.decisions)  # overflow, counted from its own events
    ok = max(summary.steps - sum(bad.values()), 0)
    return {"ok": ok, **dict(sorted(bad.items()))} if summary.steps else dict(bad)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _float(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0
