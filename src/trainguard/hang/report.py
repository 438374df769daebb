"""The hang report: ``run_dir/hangs/<id>/report.json`` and ``report.txt``.

``report.json`` holds ``id``, ``kind`` (``"hang"`` or ``"peer_failure"``), ``culprits``
(ranks), ``reason``, ``exit_code``, ``decided_by`` and ``reporter`` (ranks), ``timeout``
and ``dead_after`` (seconds), ``time`` (the reporter's unix time) and ``ranks``: per rank
``step``, ``phase``, ``state`` (``report_state``), ``heartbeat_age`` and ``progress_age``
(seconds, measured on the reporter's clock since it last saw that rank's counters change),
``host``, ``pid``, ``stack_file`` and ``collective`` (the collective it waited in and its
last few, once its loop had stalled: ``collective_record.CollectiveRecord.to_dict``; null
before). With
``collective_mismatch`` (``mismatch.Mismatch.to_dict``: kind, culprits, the first differing
sequence id, each side's ranks, collective and call sites, and the one-line ``line``) when
the ranks' collectives disagree, else null. Stacks are in ``rank-<r>.txt`` next to it, one
file per live rank. Files are written atomically (temp file, then rename).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard.hang.collective_record import CollectiveRecord
from trainguard.hang.heartbeat import RankView
from trainguard.hang.mismatch import rank_list
from trainguard.hang.rules import HANG, PEER_FAILURE, Verdict, collective_mismatch, own_failure


def stack_file(rank: int) -> str:
    return f"rank-{rank}.txt"


def report_state(view: RankView, verdict: Verdict) -> str:
    """A rank's state in the report: its last heartbeat's (``running``, ``closed``,
    ``failed``), except for a culprit of a peer failure whose heartbeat still said
    ``running``: ``failed`` when the verdict is its own exception (it published the failure
    before its heartbeat thread wrote the new state), ``stopped`` when its heartbeats
    stopped (a dead or frozen process)."""
    state = view.state
    if state != "running" or view.rank not in verdict.culprits:
        return state
    if own_failure(verdict.kind, verdict.culprits, verdict.by):  # its one culprit raised
        return "failed"
    if verdict.kind == PEER_FAILURE and view.rank in verdict.silent:
        return "stopped"
    return state


def build_report(
    hang_id: str,
    verdict: Verdict,
    views: Sequence[RankView],
    *,
    timeout: float,
    dead_after: float,
    exit_code: int,
) -> dict[str, Any]:
    ranks = []
    for view in views:
        record = view.to_dict()
        record["state"] = report_state(view, verdict)
        record["culprit"] = view.rank in verdict.culprits
        record["stack_file"] = stack_file(view.rank)
        ranks.append(record)
    mismatch = collective_mismatch(views) if verdict.kind == HANG else None
    return {
        "format": 1,
        "id": hang_id,
        "kind": verdict.kind,
        "culprits": list(verdict.culprits),
        "reason": verdict.reason,
        "exit_code": exit_code,
        "decided_by": verdict.by,
        "reporter": verdict.reporter,
        "timeout": round(timeout, 3),
        "dead_after": round(dead_after, 3),
        "time": time.time(),
        "collective_mismatch": mismatch.to_dict() if mismatch is not None else None,
        "ranks": ranks,
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as text for a person."""
    culprits = ", ".join(str(r) for r in report["culprits"]) or "none identified"
    lines = [
        f"trainguard {report['kind']} report {report['id']}",
        f"culprit ranks: {culprits}",
        f"reason: {report['reason']}",
        *mismatch_line(report),
        f"every live rank exits with code {report['exit_code']}; decided by rank "
        f"{report['decided_by']}, reported by rank {report['reporter']}",
        f"timeout {report['timeout']:g}s, dead after {report['dead_after']:g}s without heartbeat",
        "",
        f"{'rank':>4}  {'step':>6}  {'phase':<10} {'state':<8} {'heartbeat':>9}  "
        f"{'progress':>8}  host:pid",
    ]
    for r in report["ranks"]:
        mark = "*" if r["culprit"] else " "
        lines.append(
            f"{r['rank']:>3}{mark}  {r['step']:>6}  {r['phase']:<10} {r['state']:<8} "
            f"{r['heartbeat_age']:>8.1f}s  {r['progress_age']:>7.1f}s  {r['host']}:{r['pid']}"
        )
    lines += collective_lines(report)
    lines += [
        "",
        "* culprit. heartbeat / progress: seconds since the reporter last saw the rank's",
        "watchdog counter / training-progress counter change (the reporter's own clock).",
        "Stacks: rank-<r>.txt in this folder (on each rank's host).",
    ]
    return "\n".join(lines) + "\n"


def mismatch_line(report: dict[str, Any]) -> list[str]:
    """The mismatch's own line, unless the reason already says it."""
    mismatch = report.get("collective_mismatch")
    if not mismatch or mismatch["line"] in report["reason"]:
        return []
    return [mismatch["line"]]


def collective_lines(report: dict[str, Any]) -> list[str]:
    """Each rank's collective: what it waits in, its sequence id, call site and last ones."""
    rows: list[tuple[str, ...]] = []
    for r in report["ranks"]:
        record = CollectiveRecord.from_dict(r.get("collective"))
        if record is None:
            continue
        last = ", ".join(f"{c.seq} {c.op}{'' if c.done else '*'}" for c in record.last)
        rows.append(
            (
                f"{r['rank']:>3}{'*' if r['culprit'] else ' '}",
                record.what,
                "-" if record.seq is None else str(record.seq),
                record.site or "-",
                record.source,
                last,
            )
        )
    if not rows:
        return []
    head = ("rank", "waits in", "seq", "call site", "source", "last")
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head) - 1)]
    table = [
        "  ".join(
            cell.rjust(w) if i in (0, 2) else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=False))
        )
        + f"  {row[-1]}"
        for row in [head, *rows]
    ]
    return [
        "",
        "collectives (seq: sequence id in the guard's process group; last: its latest",
        "collectives from the flight recorder, * = not completed)",
        *[line.rstrip() for line in table],
        *recorder_notes(report),
    ]


def recorder_notes(report: dict[str, Any]) -> list[str]:
    """Why ranks answered from their stacks: ``ranks 0-3: flight recorder off (...)``."""
    notes: dict[str, list[int]] = {}
    for r in report["ranks"]:
        record = CollectiveRecord.from_dict(r.get("collective"))
        if record is not None and record.note:
            notes.setdefault(record.note, []).append(r["rank"])
    lines = [f"{rank_list(ranks)}: {note}" for note, ranks in notes.items()]
    if lines:
        lines.append("(trainguard doctor says how to turn the flight recorder on)")
    return lines


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_report(folder: Path, report: dict[str, Any]) -> Path:
    """Write ``report.json`` and ``report.txt`` into ``folder``; returns the JSON's path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "report.json"
    _write_atomic(path, json.dumps(report, indent=2) + "\n")
    _write_atomic(folder / "report.txt", format_report(report))
    return path
