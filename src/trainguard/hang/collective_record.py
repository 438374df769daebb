"""What one rank says about its collectives at a hang: the record that travels in its
heartbeat (``Heartbeat.collective``) and lands in ``report.json``.

A ``CollectiveRecord`` names the collective the rank waits in (``op``, ``None``: none), a
readable ``label`` (``barrier``, ``DDP's gradient all_reduce``), its sequence id and input
sizes when torch's flight recorder gave them (``source`` ``"flight_recorder"``; from the main
thread's Python stack alone: ``"stack"``, no sequence ids), the user's call site (the
innermost frame outside torch and trainguard) and ``last``: the rank's last few collectives
of the guard's process group, oldest first (flight recorder only).

Kept small on purpose: it rides every heartbeat a stalled rank publishes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

FLIGHT_RECORDER = "flight_recorder"
STACK = "stack"


@dataclass(frozen=True)
class Call:
    """One collective from the flight recorder."""

    seq: int
    op: str
    sizes: list[list[int]]
    done: bool

    def signature(self) -> tuple[str, str]:
        """What must agree across ranks at one sequence id: the op and the input sizes."""
        return self.op, repr(self.sizes)

    def to_list(self) -> list[Any]:
        return [self.seq, self.op, self.sizes, self.done]

    @staticmethod
    def from_list(raw: Any) -> Call:
        seq, op, sizes, done = raw
        return Call(int(seq), str(op), [[int(n) for n in s] for s in sizes], bool(done))


@dataclass(frozen=True)
class CollectiveRecord:
    source: str
    """``flight_recorder`` or ``stack``."""
    op: str | None
    """The collective the rank waits in (``barrier``, ``all_reduce``...); None: none."""
    label: str = ""
    """How to say it: ``barrier``, ``DDP's gradient all_reduce``, ``backward``..."""
    seq: int | None = None
    """Its sequence id in the guard's process group (flight recorder only)."""
    sizes: list[list[int]] | None = None
    file: str = ""
    line: int = 0
    function: str = ""
    last: list[Call] = field(default_factory=list)
    """The last few collectives of the group, oldest first (flight recorder only)."""
    enqueued: int | None = None
    """The group's last enqueued sequence id when the record was made (flight recorder
    only): ``last`` comes from an earlier, rate-limited dump and may end before it."""
    note: str = ""
    """Why the flight recorder did not answer, when ``source`` is ``stack``."""

    @property
    def site(self) -> str:
        """``file.py:19`` (the file's base name), or empty."""
        return f"{os.path.basename(self.file)}:{self.line}" if self.file else ""

    @property
    def what(self) -> str:
        """The label, else the op, else ``no collective``."""
        return self.label or self.op or "no collective"

    @property
    def top(self) -> int | None:
        """The highest sequence id this rank entered (flight recorder only)."""
        ends = (self.last[-1].seq if self.last else None, self.enqueued)
        tops = [n for n in ends if n is not None]
        return max(tops) if tops else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "op": self.op, "label": self.label}
        if self.seq is not None:
            out["seq"] = self.seq
        if self.sizes is not None:
            out["sizes"] = self.sizes
        if self.file:
            out.update(file=self.file, line=self.line, function=self.function, site=self.site)
        if self.last:
            out["last"] = [call.to_list() for call in self.last]
        if self.enqueued is not None:
            out["enqueued"] = self.enqueued
        if self.note:
            out["note"] = self.note
        return out

    @staticmethod
    def from_dict(raw: Any) -> CollectiveRecord | None:
        """The record in ``raw``; None when it is missing or unreadable."""
        if not isinstance(raw, dict):
            return None
        try:
            return CollectiveRecord(
                source=str(raw["source"]),
                op=None if raw.get("op") is None else str(raw["op"]),
                label=str(raw.get("label", "")),
                seq=None if raw.get("seq") is None else int(raw["seq"]),
                sizes=raw.get("sizes"),
                file=str(raw.get("file", "")),
                line=int(raw.get("line", 0)),
                function=str(raw.get("function", "")),
                last=[Call.from_list(c) for c in raw.get("last", [])],
                enqueued=None if raw.get("enqueued") is None else int(raw["enqueued"]),
                note=str(raw.get("note", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None


def describe(record: CollectiveRecord) -> str:
    """``barrier, sequence id 37, at train.py:19 (flight_recorder)``."""
    parts = [record.what]
    if record.seq is not None:
        parts.append(f"sequence id {record.seq}")
    if record.site:
        parts.append(f"at {record.site}")
    return f"{', '.join(parts)} ({record.source})"
