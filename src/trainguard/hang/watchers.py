"""Who reads whose heartbeats: a few watcher ranks read every heartbeat, the others read only
the watchers' heartbeats and the verdict key.

With every rank reading every heartbeat, one tick costs the store N * (N + 1) key reads
(16.8 million a second at 4,096 ranks and a 1 s tick). Here:

* **Watchers** (``select_watchers``: ``count`` ranks spread evenly over the members, by
  default 2, i.e. ranks ``m[0]`` and ``m[N/2]``) read every member's heartbeat, judge hangs
  and dead ranks with ``rules.assess`` exactly as before, and propose the verdict. They have
  the full view, so the verdict they decide names the culprits with step and phase and they
  write ``report.json``.
* **Every other rank** writes its heartbeat and reads the watchers' heartbeats and the
  verdict (``count + 1`` keys). It acts on the verdict like every rank. If every watcher's
  heartbeat stops for ``backup_after`` (``dead_after`` plus ``BACKUP_TICKS`` ticks, so a
  surviving watcher decides first) it proposes a peer-failure verdict naming the dead
  watchers itself; if it decides, it reads every heartbeat once for the report.
* When no watcher is running any more (all closed or failed while this rank still runs),
  this rank reads every heartbeat itself, so a hang is still seen (the old cost, for the
  ranks left).

One tick then costs about ``(2 * count + 1) * N`` key reads and ``2 * N`` requests.
``TRAINGUARD_HANG_WATCHERS`` sets ``count`` (``all``: every rank watches, the old design).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

from trainguard.hang.channel import StoreChannel
from trainguard.hang.heartbeat import Heartbeat, PeerTracker, RankView
from trainguard.hang.rules import PEER_FAILURE, Verdict, assess, stopped_ranks

logger = logging.getLogger(__name__)

ENV = "TRAINGUARD_HANG_WATCHERS"
DEFAULT_WATCHERS = 2
BACKUP_TICKS = 3
"""A non-watcher waits this many ticks past ``dead_after`` before it reports dead watchers."""


def watcher_count(environ: Mapping[str, str] | None = None) -> int | None:
    """``count`` from ``TRAINGUARD_HANG_WATCHERS`` (None: every rank watches)."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    if not raw:
        return DEFAULT_WATCHERS
    if raw == "all":
        return None
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"{ENV}={raw!r}: use a number of watcher ranks >= 1, or 'all'")
    return count


def select_watchers(members: Sequence[int], count: int | None) -> list[int]:
    """``count`` members spread evenly (the first, then every ``N/count``-th); all of them
    when ``count`` is None or not smaller than the number of members."""
    n = len(members)
    if count is None or count >= n:
        return list(members)
    return sorted({members[i * n // count] for i in range(count)})


def backup_after(dead_after: float, tick: float) -> float:
    """Seconds without a watcher heartbeat before a non-watcher reports the watcher dead."""
    return dead_after + BACKUP_TICKS * tick


class Watch:
    """This rank's view of its peers: what it reads each tick and how it judges."""

    def __init__(self, rank: int, members: Sequence[int], watchers: Sequence[int], now: float):
        self.rank = rank
        self.members = list(members)
        self.watchers = sorted(watchers)
        self.tracker = PeerTracker(self.members, now)
        self._promoted = False

    @property
    def full(self) -> bool:
        """Whether this rank reads every heartbeat now."""
        return self.rank in self.watchers or self._promoted

    def reads(self) -> list[int] | None:
        """The ranks whose heartbeats to read this tick (None: every member)."""
        return None if self.full else self.watchers

    def update(self, beats: Mapping[int, Heartbeat | None], now: float) -> None:
        for rank, beat in beats.items():
            self.tracker.update(rank, beat, now)
        if not self.full and self._watchers_left(now):
            self._promoted = True
            # the ranks it did not watch (itself included) were never read: their ages count
            # from now, not from the watchdog's start (they would all look long silent)
            self.tracker.count_unseen_from(now)
            logger.info(
                "trainguard watchdog: no watcher runs any more; rank %d reads all", self.rank
            )

    def judge(self, now: float, timeout: float, dead_after: float, tick: float) -> Verdict | None:
        """A verdict this rank proposes, or None."""
        if self.full:
            return assess(self.tracker.views(now), self.rank, timeout, dead_after)
        watched = self.tracker.views(now, self.watchers)
        limit = backup_after(dead_after, tick)
        stopped = stopped_ranks(watched, self.rank, limit)
        if not stopped or len(stopped) < len([v for v in watched if v.state == "running"]):
            return None  # a watcher still runs: it judges
        ages = ", ".join(
            f"rank {v.rank} {v.heartbeat_age:.1f}s" for v in watched if v.rank in stopped
        )
        reason = (
            f"heartbeats of the watcher ranks stopped ({ages} without a heartbeat): the "
            "process died or its interpreter is frozen"
        )
        return Verdict(
            PEER_FAILURE, stopped, reason, by=self.rank, reporter=self.rank, silent=stopped
        )

    def report_views(self, channel: StoreChannel, now: float) -> list[RankView]:
        """Every member's view for ``report.json``; a non-watcher reads every heartbeat once
        (the ages of ranks it did not watch then count from this read)."""
        if not self.full:
            try:
                beats, _ = channel.read(None)
                for rank, beat in beats.items():
                    if rank not in self.watchers:
                        self.tracker.update(rank, beat, now)
            except Exception as exc:
                logger.warning("trainguard watchdog: heartbeats for the report not read: %s", exc)
        return self.tracker.views(now)

    def _watchers_left(self, now: float) -> bool:
        watched = self.tracker.views(now, self.watchers)
        return all(v.registered and v.state in ("closed", "failed") for v in watched)
