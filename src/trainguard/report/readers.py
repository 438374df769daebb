"""Tolerant readers for a run directory's files: what cannot be read is counted, not fatal."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.capture.forward_inputs import describe, made_in_loop

REPLAY_RESULT = "replay.json"
"""A bundle's replay result, written by ``trainguard replay`` next to the manifest."""


def int_of(value: Any) -> int:
    """A JSON field as an int (0 when it is missing or no int: a torn or foreign line)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def float_of(value: Any) -> float:
    """A JSON field as a float (0.0 when it is missing or no number)."""
    return float(value) if isinstance(value, (int, float)) else 0.0


@dataclass
class Skipped:
    """Lines or files that could not be read, by path (relative to the run dir)."""

    lines: dict[str, int] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    """Whole files that could not be read, with the reason."""

    def add_lines(self, name: str, count: int) -> None:
        if count:
            self.lines[name] = self.lines.get(name, 0) + count

    def add_file(self, name: str, reason: str) -> None:
        self.files[name] = reason


def read_jsonl(path: Path, run_dir: Path, skipped: Skipped) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file; torn or garbage lines are counted in ``skipped``."""
    name = _relative(path, run_dir)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        skipped.add_file(name, f"{type(exc).__name__}: {exc.strerror or exc}")
        return []
    records: list[dict[str, Any]] = []
    bad = 0
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(value, dict):
            records.append(value)
        else:
            bad += 1
    skipped.add_lines(name, bad)
    return records


def read_events(root: Path, skipped: Skipped) -> list[dict[str, Any]]:
    """Every rank's events (``events/*.jsonl``), in time order. A line whose core fields are
    not what the guard writes (``kind`` a string, ``time`` a number, ``step`` an int or null,
    ``rank`` an int where present) is garbage: counted in ``skipped``, not reported."""
    records = []
    for path in sorted((root / "events").glob("*.jsonl")):
        lines = read_jsonl(path, root, skipped)
        good = [rec for rec in lines if is_event(rec)]
        skipped.add_lines(_relative(path, root), len(lines) - len(good))
        records += good
    return sorted(records, key=lambda r: (float(r["time"]), int_of(r.get("rank"))))


def is_event(record: dict[str, Any]) -> bool:
    """Whether a JSON object has an event's core fields, of the types the guard writes."""
    kind, step, rank = record.get("kind"), record.get("step"), record.get("rank")
    return (
        isinstance(kind, str)
        and bool(kind)
        and _finite_number(record.get("time"))
        and (step is None or _is_int(step))
        and ("rank" not in record or _is_int(rank))
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_json(path: Path, run_dir: Path, skipped: Skipped) -> dict[str, Any] | None:
    """A JSON object from a file, or None (counted in ``skipped``) when it cannot be read."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        skipped.add_file(_relative(path, run_dir), type(exc).__name__)
        return None
    if not isinstance(value, dict):
        skipped.add_file(_relative(path, run_dir), "not a JSON object")
        return None
    return value


def _relative(path: Path, run_dir: Path) -> str:
    try:
        return str(path.relative_to(run_dir))
    except ValueError:
        return str(path)


def read_captures(root: Path, skipped: Skipped) -> list[dict[str, Any]]:
    """Each capture bundle's manifest facts, and its replay result when one was saved."""
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
                "run": manifest.get("run"),
                "time": manifest.get("time"),
                "path": str(folder.relative_to(root)),
                "reason": manifest.get("reason"),
                "trigger": manifest.get("trigger"),
                "ranks": manifest.get("ranks"),
                "history": (folder / "history.json").is_file(),
                "diagnosis": result.get("summary") if result else None,
                "reproduced": result.get("reproduced") if result else None,
                "made_in_loop": _made_in_loop(folder, manifest.get("ranks"), root, skipped),
            }
        )
    return captures


def _made_in_loop(folder: Path, ranks: Any, root: Path, skipped: Skipped) -> list[dict[str, Any]]:
    """The ranks whose forward got a non-finite input their fetched batch did not hold
    (``meta.json`` ``forward_inputs``, ``capture/forward_inputs.py``), and where."""
    found = []
    for rank in ranks if isinstance(ranks, list) else []:
        meta = read_json(folder / f"rank-{rank}" / "meta.json", root, skipped)
        inputs = meta.get("forward_inputs") if meta else None
        if isinstance(inputs, dict) and made_in_loop(inputs):
            found.append({"rank": rank, "where": describe(inputs)})
    return found


def read_hangs(root: Path, skipped: Skipped) -> list[dict[str, Any]]:
    """Each hang report's facts (the lowest step a rank was at)."""
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
                "no_stack": _unwritten_stacks(path.parent, report),
            }
        )
    return hangs


def _unwritten_stacks(folder: Path, report: dict[str, Any]) -> dict[str, list[int]]:
    """The ranks of a hang report with no stack here: ``empty`` (no stack written on this
    host: the file each rank opens up front is empty or absent, the process ended before it
    could write, e.g. SIGKILL, an abort or its own exception) and ``elsewhere`` (a rank on
    another host than the reporter's: its file is on that host's disk)."""
    records = [r for r in report.get("ranks") or [] if isinstance(r, dict)]
    hosts = {r.get("rank"): r.get("host") for r in records}
    here = hosts.get(report.get("reporter"))
    empty: list[int] = []
    elsewhere: list[int] = []
    for record in records:
        rank, name = record.get("rank"), record.get("stack_file")
        if not isinstance(rank, int) or not isinstance(name, str):
            continue
        try:
            size = (folder / Path(name).name).stat().st_size
        except OSError:
            size = 0
        if size > 0:
            continue
        if here is not None and record.get("host") not in (None, here):
            elsewhere.append(rank)
        else:
            empty.append(rank)
    return {"empty": empty, "elsewhere": elsewhere}
