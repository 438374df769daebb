"""Tolerant readers for a run directory's files: what cannot be read is counted, not fatal."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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


def number(value: Any) -> float | None:
    """A float from a JSON value (``"nan"``/``"inf"`` strings included), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _relative(path: Path, run_dir: Path) -> str:
    try:
        return str(path.relative_to(run_dir))
    except ValueError:
        return str(path)
