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
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.events import number
from trainguard.report.crashes import read_crashes, with_comm_errors
from trainguard.report.decisions import decision_counts, metric_decisions, metric_nonfinite
from trainguard.report.ending import ending
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
    summary.hangs = _live_steps(own(found.hangs, None), events) or _hang_events(events)
    summary.crashes = with_comm_errors(own(found.crashes, None), events)
    summary.ended = ending(events, summary.hangs, own(found.records, None), summary.crashes)
    starts = run_starts(events, own(found.records, None))
    # a run killed before its batched metrics lines were flushed: its events still say
    # how far each start got (a phase entered at step N: N steps were checked)
    summary.steps = max([_count_steps(events, summary.points), *(s.end for s in starts[-1:])])
    summary.starts = len(starts)
    summary.first_step = starts[0].begin if starts else 0
    summary.steps_run = sum(s.steps for s in starts)
    others = {kind: len(_merged(events, kind)) for kind in ("overflow", "dropped")}
    # the sync-free step's skips before a mask in the batch was learned: no nonfinite event
    others["skip"] = sum(e.get("reason") == "input_mask" for e in _merged(events, "skip"))
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


def _merged(
    events: list[dict[str, Any]], *kinds: str, keys: tuple[str, ...] = _KEY_FIELDS
) -> list[dict[str, Any]]:
    """One copy of each event written by several ranks (the lowest rank's), in the order they
    happened. A step number seen again after a rollback is a new event: the n-th of a kind at
    a step on one rank is merged with the n-th on the others, and the passes follow each other
    (the first pass's steps, then the second's), never interleaved by step number."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    occurrences: Counter[tuple[Any, ...]] = Counter()
    for event in events:  # in time order
        if event["kind"] not in kinds:
            continue
        rank = int_of(event.get("rank"))
        key = (event["kind"], event.get("step"), *(str(event.get(f)) for f in keys))
        occurrences[(rank, key)] += 1
        key = (*key, occurrences[(rank, key)])
        if key not in seen or rank < int_of(seen[key].get("rank")):
            seen[key] = event
    return sorted(seen.values(), key=lambda e: (float_of(e.get("time")), int_of(e.get("step"))))


def _with_every_ranks_tensors(
    merged: list[dict[str, Any]], events: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each merged ``bad_input`` with the tensors every rank named (a rank names its own bad
    entries only: the lowest rank's copy alone would often name none), each with its rank."""
    named: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for event in events:
        if event["kind"] == "bad_input":
            key = (event.get("step"), event.get("run"))
            for tensor in event.get("tensors") or []:
                if isinstance(tensor, dict):
                    entry = {**tensor, "rank": event.get("rank")}
                    if entry not in named.setdefault(key, []):
                        named[key].append(entry)
    return [{**e, "tensors": named.get((e.get("step"), e.get("run")), [])} for e in merged]


def _fill_from_events(summary: RunSummary, events: list[dict[str, Any]]) -> None:
    start = next((e for e in events if e["kind"] == "start"), None)
    if start is not None and isinstance(start.get("world_size"), int):
        summary.world_size = start["world_size"]
    nonfinite = _merged(events, "nonfinite")
    fields = ("step", "where", "ranks", "action", "params")
    summary.nonfinite = [{k: e.get(k) for k in fields} for e in nonfinite]
    if nonfinite:  # the first in time (after a rollback a lower step number comes later)
        first = min(nonfinite, key=lambda e: float_of(e.get("time")))
        summary.first_bad = {k: first.get(k) for k in fields}
    summary.spikes = _merged(events, "spike")
    summary.rollbacks = _merged(events, "rollback", "rollback_refused")
    summary.checkpoints = _merged(events, *_CHECKPOINT_KINDS)
    summary.escalations = _escalations(events)
    summary.bad_input = _with_every_ranks_tensors(_merged(events, "bad_input"), events)
    summary.capture_failures = _merged(events, "capture_failed", keys=())
    summary.stood_aside = _merged(events, "stand_aside", keys=())
    summary.uneven_data = _merged(events, "uneven_data", "partial_step")
    summary.failed_too = _merged(events, "failed_too", keys=("rank",))
    summary.stragglers = _merged(events, "straggler", keys=("phase",))
    summary.replicas = _merged(events, "replica_divergence")
    summary.reruns = _merged(events, "rerun")
    summary.hosts = _host_counts(summary.reruns, _merged(events, "suspect_host"))


def _fill_from_metrics(summary: RunSummary) -> None:
    """Decisions and non-finite steps from the metrics log's lines (no readable events)."""
    summary.nonfinite = metric_nonfinite(summary.points)
    if summary.nonfinite:
        summary.first_bad = {**summary.nonfinite[0], "from": "metrics"}
    summary.decisions = metric_decisions(summary.points, summary.steps_run, summary.steps)


def _escalations(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Escalations that stopped the run (``escalate`` events) and those answered by a
    rollback (a ``rollback`` event; its cause from the step's non-finite or spike event)."""
    stops = [{**e, "outcome": "stopped"} for e in _merged(events, "escalate")]
    rolled = [
        {
            **e,
            "kind": "escalate",
            **_cause(events, e),
            "outcome": f"rolled back to step {e.get('restored_step')}",
        }
        for e in _merged(events, "rollback")
    ]
    return sorted([*stops, *rolled], key=lambda e: (int_of(e.get("step")), float_of(e.get("time"))))


def _cause(events: list[dict[str, Any]], rollback: dict[str, Any]) -> dict[str, Any]:
    """Why a rollback happened: the same rank's last non-finite or spike event of its step."""
    found = [
        e
        for e in events
        if e["kind"] in ("nonfinite", "spike")
        and e.get("rank") == rollback.get("rank")
        and e.get("step") == rollback.get("step")
        and float_of(e.get("time")) <= float_of(rollback.get("time"))
    ]
    if not found:
        return {"reason": "escalation"}
    last = found[-1]
    reason = "spike" if last["kind"] == "spike" else "non-finite"
    return {"reason": reason, "consecutive": last.get("consecutive")}


def _live_steps(hangs: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each hang at the lowest step its ranks' own ``hang`` / ``peer_failure`` events name
    (each rank's step when it acted) rather than the heartbeats' (a second old: a rank that
    failed in its first second read as step 0); a rank that wrote none is not counted."""
    for hang in hangs:
        steps = [
            int_of(e.get("step"))
            for e in events
            if e["kind"] in ("hang", "peer_failure") and e.get("hang_id") == hang.get("id")
        ]
        if steps:
            hang["step"] = min(steps)
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
    counts = [int_of(e.get("step")) for e in events if e["kind"] == "close"]
    counts += [int_of(e.get("step")) + 1 for e in events if e["kind"] in ("nonfinite", "spike")]
    counts += [p.step + 1 for p in points[-1:]]
    counts += [int_of(h.get("step")) for h in _hang_events(events)]
    return max(counts, default=0)
