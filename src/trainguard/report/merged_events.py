"""Events every rank wrote, merged into one copy each, and the lists the report builds from
them: escalations with their outcome and cause, hangs (the live steps of the ranks, or
their events), the hosts named by reruns and suspect-host verdicts.

Every rank writes its own events, so per-rank copies of the same event (a non-finite step,
a rollback, a hang) stand in every rank's log: ``merged`` keeps one of each, the lowest
rank's, in the order they happened (``report/summary.py`` reads them).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from trainguard.report.readers import float_of, int_of

_KEY_FIELDS = ("metric", "hang_id", "path", "reason")


def merged(
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


def with_every_ranks_tensors(
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


def escalations(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Escalations that stopped the run (``escalate`` events) and those answered by a
    rollback (a ``rollback`` event; its cause from the step's non-finite or spike event)."""
    stops = [{**e, "outcome": "stopped"} for e in merged(events, "escalate")]
    rolled = [
        {
            **e,
            "kind": "escalate",
            **_cause(events, e),
            "outcome": f"rolled back to step {e.get('restored_step')}",
        }
        for e in merged(events, "rollback")
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


def live_steps(hangs: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


def hang_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
        for e in merged(events, "hang", "peer_failure")
    ]


def host_counts(
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
