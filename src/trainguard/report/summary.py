"""What happened in a run, read from its directory: events, metrics, captures and hangs.

A directory may hold several runs (a script run again with the same ``run_dir``): each
summary is of one run (``runs.py`` says what belongs to which), the latest by default.
Every rank writes its own events, so per-rank copies of the same event (a non-finite step,
a skip, a spike, a rollback) are merged by kind and step, keeping the lowest rank's. What
cannot be read (a torn last line of a killed run, garbage, an unreadable file) is skipped
and counted in ``RunSummary.skipped``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.events import number
from trainguard.report.crashes import read_crashes, with_comm_errors
from trainguard.report.decisions import decision_counts, metric_decisions, metric_nonfinite
from trainguard.report.ending import ending
from trainguard.report.merged_events import (
    escalations,
    hang_events,
    host_counts,
    live_steps,
    merged,
    with_every_ranks_tensors,
)
from trainguard.report.readers import (
    Skipped,
    float_of,
    int_of,
    read_captures,
    read_events,
    read_hangs,
    read_jsonl,
)
from trainguard.report.runs import ALL, RunInfo, Timeline, latest, list_runs, run_of
from trainguard.report.starts import run_starts
from trainguard.report.timing import StepTimes, phase_summary, rank_table, step_times
from trainguard.runs.reached_mark import read_marks

_CHECKPOINT_KINDS = (
    "checkpoint",
    "checkpoint_good",
    "checkpoint_damaged",
    "failure_state_refused",
    "resume",
)


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
    run: str | None = None
    """The run summarized (None: the directory names no run: no events)."""
    runs: list[dict[str, Any]] = field(default_factory=list)
    """Every run in the directory, oldest first: ``id``, ``start``, ``start_utc``, ``steps``,
    ``starts`` (guards started for it: 1 + torchrun restarts and resumes)."""
    world_size: int | None = None
    steps: int = 0
    first_step: int = 0
    """The step the run started at: 0, or the step of the state it loaded (a new run from a
    checkpoint, ``guard.load_state_dict``) or resumed from (``report/starts.py``)."""
    starts: int = 0
    """Its starts: 1, or more after torchrun restarts and resumes (0: nothing was read)."""
    steps_run: int = 0
    """Steps run, every start's (``report/starts.py``), those a restart or a rollback ran
    again counted again."""
    ended: str = ""
    """How the run's last start ended (``report/ending.py``)."""
    decisions: dict[str, int] = field(default_factory=dict)
    first_bad: dict[str, Any] | None = None
    """The first non-finite step in time (``from``: ``metrics`` when read from the metrics
    log, the run's events being missing or unreadable)."""
    nonfinite: list[dict[str, Any]] = field(default_factory=list)
    captures: list[dict[str, Any]] = field(default_factory=list)
    stood_aside: list[dict[str, Any]] = field(default_factory=list)
    """``trainguard run``'s guard stood aside (``stand_aside`` events): unguarded from then."""
    capture_failures: list[dict[str, Any]] = field(default_factory=list)
    """``capture_failed`` events (one per step; the lowest rank's): a bundle tried, not written."""
    spikes: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    failure_states: list[dict[str, Any]] = field(default_factory=list)
    """States at a failure, one entry a failure: the step, the ranks that saved, and each
    rank that did not with its reason (``failure_state`` events: docs/recovery.md)."""
    escalations: list[dict[str, Any]] = field(default_factory=list)
    """Every escalation: those that stopped the run (``escalate`` events, ``outcome``
    ``stopped``) and those a rollback answered (``outcome`` ``rolled back to step N``)."""
    bad_input: list[dict[str, Any]] = field(default_factory=list)
    hangs: list[dict[str, Any]] = field(default_factory=list)
    crashes: list[dict[str, Any]] = field(default_factory=list)
    """Ranks a signal ended (SIGABRT, SIGSEGV, a launcher's SIGTERM), from the stacks
    faulthandler wrote: ``report/crashes.py``."""
    failed_too: list[dict[str, Any]] = field(default_factory=list)
    """``failed_too`` events: ranks that failed on their own while another rank's failure
    was the verdict (each rank's own)."""
    uneven_data: list[dict[str, Any]] = field(default_factory=list)
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """``straggler`` events (one copy per step and phase), in step order."""
    replicas: list[dict[str, Any]] = field(default_factory=list)
    """``replica_divergence`` events (replicated weights that differ across ranks)."""
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
        return not (self.events or self.points or self.captures or self.hangs or self.crashes)

    def nonfinite_cells(self) -> list[tuple[int, int]]:
        """(rank, step) pairs where a non-finite value appeared (events and metrics)."""
        flagged = [*self.nonfinite, *self.bad_input]
        cells = {(r, int_of(e.get("step"))) for e in flagged for r in e.get("ranks") or []}
        cells |= {(r, p.step) for p in self.points for r in p.bad_ranks}
        return sorted(cells)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("points")
        out["metric_steps"] = len(self.points)
        return out


class UnknownRun(ValueError):
    """``--run ID`` names no run of the directory (the message lists them)."""


@dataclass
class _RunDir:
    """Everything readable in a run directory, read once."""

    root: Path
    skipped: Skipped
    events: list[dict[str, Any]]
    records: list[dict[str, Any]]
    """The metrics log's lines (with an int ``step``)."""
    marks: list[dict[str, Any]]
    """The last step each process recorded (``runs/reached_mark.py``), ``step`` and
    ``time``: how far a start killed before its lines were flushed got."""
    captures: list[dict[str, Any]]
    hangs: list[dict[str, Any]]
    crashes: list[dict[str, Any]]
    runs: list[RunInfo]
    timeline: Timeline


def summarize(run_dir: Path | str, run: str | None = None) -> RunSummary:
    """Read one run of a run directory: ``run`` is its id, None the latest. Never raises on
    damaged content (see ``RunSummary.skipped``); ``UnknownRun`` for an id it does not hold."""
    found = _load(Path(run_dir))
    if not found.runs:  # no events: nothing names a run, everything is one
        return _summary(found, None)
    if run is None:
        chosen = latest(found.runs)
        run = chosen.id if chosen is not None else None
    if run not in {r.id for r in found.runs}:
        raise UnknownRun(_unknown(found, str(run)))
    return _summary(found, run)


def summarize_all(run_dir: Path | str) -> list[RunSummary]:
    """Every run of a run directory, oldest first (one summary when none is named)."""
    found = _load(Path(run_dir))
    return [_summary(found, r.id) for r in found.runs] or [_summary(found, None)]


def _unknown(found: _RunDir, run: str) -> str:
    ids = ", ".join(r.id for r in found.runs)
    return (
        f"{found.root} has no run {run!r}; its runs: {ids} (details: trainguard report "
        f"{found.root} --runs; every run: --run {ALL})"
    )


def _load(root: Path) -> _RunDir:
    skipped = Skipped()
    events = read_events(root, skipped)
    runs = list_runs(events)
    return _RunDir(
        root=root,
        skipped=skipped,
        events=events,
        records=_read_records(root, skipped),
        marks=read_marks(root / "metrics"),
        captures=read_captures(root, skipped),
        hangs=read_hangs(root, skipped),
        crashes=read_crashes(root, skipped),
        runs=runs,
        timeline=Timeline(events, runs),
    )


def _summary(found: _RunDir, run: str | None) -> RunSummary:
    """The summary of ``run`` (None: of everything in the directory)."""
    summary = RunSummary(run_dir=str(found.root), run=run, skipped=found.skipped)
    own = _owned(found, run)
    events = [e for e in found.events if run is None or run_of(e) == run]
    summary.events = len(events)
    summary.points = _points(own(found.records, None))
    times = [p.times for p in summary.points if p.times is not None]
    summary.timing, summary.timing_summary = rank_table(times), phase_summary(times)
    _fill_from_events(summary, events)
    summary.captures = own(found.captures, "run")
    summary.hangs = live_steps(own(found.hangs, None), events) or hang_events(events)
    summary.crashes = with_comm_errors(own(found.crashes, None), events)
    summary.ended = ending(events, summary.hangs, own(found.records, None), summary.crashes)
    starts = run_starts(events, own(found.records + found.marks, None))
    # a run killed before its batched metrics lines were flushed: its events still say
    # how far each start got (a phase entered at step N: N steps were checked)
    summary.steps = max([_count_steps(events, summary.points), *(s.end for s in starts[-1:])])
    summary.starts = len(starts)
    summary.first_step = starts[0].begin if starts else 0
    summary.steps_run = sum(s.steps for s in starts)
    others = {kind: len(merged(events, kind)) for kind in ("overflow", "dropped")}
    # the sync-free step's skips before a mask in the batch was learned: no nonfinite event
    others["skip"] = sum(e.get("reason") == "input_mask" for e in merged(events, "skip"))
    summary.decisions = decision_counts(
        summary.nonfinite, others, summary.spikes, summary.steps_run, summary.steps
    )
    if not events:  # events missing or unreadable: what the metrics log says
        _fill_from_metrics(summary)
    if run is not None:
        summary.runs = [_listed(found, info, summary) for info in found.runs]
    return summary


def _owned(found: _RunDir, run: str | None) -> Any:
    """A filter of items (metrics lines, captures, hangs) to those of ``run``: by the run they
    name (``key``), else by their ``time``."""

    def own(items: list[dict[str, Any]], key: str | None) -> list[dict[str, Any]]:
        if run is None or len(found.runs) == 1:
            return items
        return [
            item
            for item in items
            if (item.get(key) if key and item.get(key) else found.timeline.run_at(item.get("time")))
            == run
        ]

    return own


def _listed(found: _RunDir, info: RunInfo, summary: RunSummary) -> dict[str, Any]:
    """A run as ``RunSummary.runs`` lists it (its steps counted as its own summary would)."""
    if info.id == summary.run:
        info.steps = summary.steps
    else:
        own = _owned(found, info.id)
        events = [e for e in found.events if run_of(e) == info.id]
        points = _points(own(found.records, None))
        info.steps = _count_steps(events, points)
    return info.to_dict()


def _read_records(root: Path, skipped: Skipped) -> list[dict[str, Any]]:
    """The metrics log's lines that name a step (the others are counted as unreadable)."""
    path = root / "metrics" / "rank-0.jsonl"
    if not path.is_file():
        return []
    records = []
    for rec in read_jsonl(path, root, skipped):
        if not isinstance(rec.get("step"), int):
            skipped.add_lines(str(path.relative_to(root)), 1)
            continue
        records.append(rec)
    return records


def _points(records: list[dict[str, Any]]) -> list[StepPoint]:
    points: dict[int, StepPoint] = {}
    for rec in records:
        step = rec["step"]
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


def _fill_from_events(summary: RunSummary, events: list[dict[str, Any]]) -> None:
    start = next((e for e in events if e["kind"] == "start"), None)
    if start is not None and isinstance(start.get("world_size"), int):
        summary.world_size = start["world_size"]
    nonfinite = merged(events, "nonfinite")
    fields = ("step", "where", "ranks", "action", "params")
    summary.nonfinite = [{k: e.get(k) for k in fields} for e in nonfinite]
    if nonfinite:  # the first in time (after a rollback a lower step number comes later)
        first = min(nonfinite, key=lambda e: float_of(e.get("time")))
        summary.first_bad = {k: first.get(k) for k in fields}
    summary.spikes = merged(events, "spike")
    summary.rollbacks = merged(events, "rollback", "rollback_refused")
    summary.checkpoints = merged(events, *_CHECKPOINT_KINDS)
    summary.failure_states = failure_states(events)
    summary.escalations = escalations(events)
    summary.bad_input = with_every_ranks_tensors(merged(events, "bad_input"), events)
    summary.capture_failures = merged(events, "capture_failed", keys=())
    summary.stood_aside = merged(events, "stand_aside", keys=())
    summary.uneven_data = merged(events, "uneven_data", "partial_step")
    summary.failed_too = merged(events, "failed_too", keys=("rank",))
    summary.stragglers = merged(events, "straggler", keys=("phase",))
    summary.replicas = merged(events, "replica_divergence")
    summary.reruns = merged(events, "rerun")
    summary.hosts = host_counts(summary.reruns, merged(events, "suspect_host"))


def _fill_from_metrics(summary: RunSummary) -> None:
    """Decisions and non-finite steps from the metrics log's lines (no readable events)."""
    summary.nonfinite = metric_nonfinite(summary.points)
    if summary.nonfinite:
        summary.first_bad = {**summary.nonfinite[0], "from": "metrics"}
    summary.decisions = metric_decisions(summary.points, summary.steps_run, summary.steps)


def _count_steps(events: list[dict[str, Any]], points: list[StepPoint]) -> int:
    counts = [int_of(e.get("step")) for e in events if e["kind"] == "close"]
    counts += [int_of(e.get("step")) + 1 for e in events if e["kind"] in ("nonfinite", "spike")]
    counts += [p.step + 1 for p in points[-1:]]
    counts += [int_of(h.get("step")) for h in hang_events(events)]
    return max(counts, default=0)


def failure_states(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``failure_state`` events grouped by step: who saved, who did not."""
    groups: dict[Any, dict[str, Any]] = {}
    for e in events:
        if e.get("kind") != "failure_state":
            continue
        group = groups.setdefault(
            e.get("step"), {"step": e.get("step"), "saved": [], "not_saved": []}
        )
        if e.get("saved"):
            group["saved"].append(e.get("rank"))
        else:
            group["not_saved"].append({"rank": e.get("rank"), "reason": e.get("reason")})
    return list(groups.values())
