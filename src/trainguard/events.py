"""Per-rank JSONL event log: ``run_dir/events/rank-{r}.jsonl``, and reading it back.

Each line is one JSON object with at least ``time`` (unix seconds), ``rank``, ``step`` and
``kind``, and ``run``: the id of the run it belongs to (``trainguard.runs.identity``; absent
in logs written before runs had ids, and from an EventLog made without one). Lines are
flushed as they are written so a killed run keeps its events.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from trainguard.runs.identity import RunIdentity


def to_jsonable(value: Any) -> Any:
    """``value`` as strict JSON can hold it: NaN/Inf as strings, paths and tuples converted."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan" / "inf": strict JSON has no NaN
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def number(value: Any) -> float | None:
    """A float from a JSON value as ``to_jsonable`` wrote it (``"nan"``/``"inf"``/``"-inf"``
    strings included), else None (a bool, None, anything else)."""
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


logger = logging.getLogger(__name__)

Listener = Callable[[dict[str, Any]], None]
"""Called with each record after its line is written (``EventLog.add_listener``)."""


class EventLog:
    """Append-only event log of one rank. Thread-safe (the watchdog writes from a thread)."""

    def __init__(self, run_dir: Path, rank: int, run: RunIdentity | None = None) -> None:
        self.path = Path(run_dir) / "events" / f"rank-{rank}.jsonl"
        self.rank = rank
        self.run = run
        """The run every line is written for (None: lines carry no ``run``)."""
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        self._listeners: list[Listener] = []

    def write(self, kind: str, step: int | None, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"time": time.time(), "rank": self.rank, "step": step}
        record["kind"] = kind
        if self.run is not None:
            record["run"] = self.run.id
        record.update(fields)
        line = json.dumps(to_jsonable(record), allow_nan=False)
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(line + "\n")
            self._file.flush()
        for listener in list(self._listeners):
            self._tell(listener, record)
        return record

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(record)`` after each event is written (the record as ``write``
        returns it: ``time``, ``rank``, ``step``, ``kind`` and the fields). It runs on the
        writing thread (the training loop's, or the hang watchdog's for ``hang`` and
        ``peer_failure``, just before the process exits): keep it short; what it raises is
        logged, never passed on to the run."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    @staticmethod
    def _tell(listener: Listener, record: dict[str, Any]) -> None:
        try:
            listener(record)
        except Exception:
            logger.exception("trainguard: event listener %r failed on %s", listener, record["kind"])

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(
    run_dir: Path | str, rank: int | None = None, run: str | None = None
) -> list[dict[str, Any]]:
    """Every event in ``run_dir`` (or of one rank; of one run: its id), ordered by time. Torn
    last lines are skipped."""
    folder = Path(run_dir) / "events"
    paths = [folder / f"rank-{rank}.jsonl"] if rank is not None else sorted(folder.glob("*.jsonl"))
    records = [rec for path in paths if path.exists() for rec in _read_lines(path)]
    if run is not None:
        records = [rec for rec in records if rec.get("run") == run]
    return sorted(records, key=lambda r: (r.get("time", 0.0), r.get("rank", 0)))


def _read_lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill mid-write
