"""Heartbeats: what each rank publishes about itself, and what a rank makes of its peers'.

A heartbeat carries two counters: ``seq`` grows on every watchdog tick (the watchdog thread
is alive), ``beats`` grows whenever the training loop makes progress (``Progress.enter``).
Readers never compare the clocks of two hosts: they note, on their own monotonic clock,
when they last saw each counter change, and judge the peer from those local ages.

A rank whose loop has stalled for a while adds ``collective``: the collective it waits in
(``collective_record.CollectiveRecord.to_dict``), so the watcher that judges a hang can
compare the ranks' collectives. Absent (not even ``null``) the rest of the time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

STATES = ("running", "closed", "failed")
"""``closed``: the guard was closed (or the process is exiting normally); ``failed``: the
rank is going down with its own exception, which it published."""


@dataclass(frozen=True)
class Heartbeat:
    seq: int
    step: int
    phase: str
    beats: int
    user_phase: bool
    timeout: float
    state: str = "running"
    host: str = ""
    pid: int = 0
    collective: dict[str, Any] | None = None

    def encode(self) -> str:
        fields = vars(self)  # asdict: 4x slower
        if self.collective is None:
            fields = {k: v for k, v in fields.items() if k != "collective"}
        return json.dumps(fields, separators=(",", ":"))

    @staticmethod
    def decode(raw: bytes | str) -> Heartbeat | None:
        """The heartbeat in ``raw``; None for an empty or unreadable value."""
        try:
            data: Any = json.loads(raw)
            return Heartbeat(**data)
        except (ValueError, TypeError):
            return None


@dataclass(frozen=True)
class RankView:
    """One rank as this rank sees it now. Ages are local seconds (this rank's clock)."""

    rank: int
    registered: bool
    """False until its first heartbeat arrived (its Guard is not created yet)."""
    state: str
    step: int
    phase: str
    user_phase: bool
    timeout: float
    heartbeat_age: float
    """Seconds since its ``seq`` counter last changed: its watchdog thread's liveness."""
    progress_age: float
    """Seconds since its ``beats`` counter last changed: its training loop's progress."""
    host: str = ""
    pid: int = 0
    collective: dict[str, Any] | None = None
    """Its collective record (the latest heartbeat's), once its loop stalled."""

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["heartbeat_age"] = round(self.heartbeat_age, 3)
        record["progress_age"] = round(self.progress_age, 3)
        return record


@dataclass
class _Seen:
    beat: Heartbeat | None = None
    seq_at: float = 0.0
    beats_at: float = 0.0


class PeerTracker:
    """Local receipt times of every member rank's counters (a rank's record is created at
    its first heartbeat: a watcher of 4,096 ranks keeps 4,096, the others a few)."""

    def __init__(self, ranks: list[int], now: float) -> None:
        self._ranks = sorted(ranks)
        self._start = now
        self._seen: dict[int, _Seen] = {}

    def _record(self, rank: int) -> _Seen:
        seen = self._seen.get(rank)
        return seen if seen is not None else _Seen(seq_at=self._start, beats_at=self._start)

    def count_unseen_from(self, now: float) -> None:
        """The ranks not read yet count their ages from ``now`` (a non-watcher about to
        read every heartbeat: it never looked at them, they were not silent to it)."""
        self._start = now

    def update(self, rank: int, beat: Heartbeat | None, now: float) -> None:
        if beat is None:
            return
        seen = self._seen.setdefault(rank, self._record(rank))
        previous = seen.beat
        if previous is None or beat.seq != previous.seq:
            seen.seq_at = now
        if previous is None or beat.beats != previous.beats or beat.step != previous.step:
            seen.beats_at = now
        seen.beat = beat

    def views(self, now: float, ranks: list[int] | None = None) -> list[RankView]:
        """Every member's view (or those of ``ranks``), by rank."""
        chosen = self._ranks if ranks is None else sorted(ranks)
        return [self._view(rank, self._record(rank), now) for rank in chosen]

    @staticmethod
    def _view(rank: int, seen: _Seen, now: float) -> RankView:
        beat = seen.beat
        if beat is None:
            return RankView(
                rank,
                registered=False,
                state="running",
                step=-1,
                phase="absent",
                user_phase=False,
                timeout=0.0,
                heartbeat_age=now - seen.seq_at,
                progress_age=now - seen.beats_at,
            )
        return RankView(
            rank,
            registered=True,
            state=beat.state,
            step=beat.step,
            phase=beat.phase,
            user_phase=beat.user_phase,
            timeout=beat.timeout,
            heartbeat_age=now - seen.seq_at,
            progress_age=now - seen.beats_at,
            host=beat.host,
            pid=beat.pid,
            collective=beat.collective,
        )
