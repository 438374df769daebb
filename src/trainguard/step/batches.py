"""A step's micro-batches by index: the items ``watch()`` handed out, matched to the steps.

With ``accumulation_steps=k`` step ``s`` trains on the items ``s*k .. s*k+k-1`` that
``watch()`` yielded, whatever the loop fetched ahead: a fast loop takes the next batch
before the optimizer step, so at ``check()`` the last item handed out belongs to the next
step. The items handed out and not yet decided wait here, in order; each decided step takes
the first ``k`` of them (references, never copies).

A loop that takes more or fewer than ``k`` items per step (``accumulation_steps`` not set to
what the loop does, or a batch the loop used without a ``check()``) would make a capture
hold the wrong batches; it is said once, with an ``batch_mismatch`` event and a log line that
names the fix, and the waiting list is bounded so that such a loop cannot hold memory.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from trainguard.capture.rng import RngSnapshot
from trainguard.events import EventLog

logger = logging.getLogger(__name__)

MAX_AHEAD = 64
"""Items handed out ahead of the decided steps beyond which the oldest are let go."""


class StepBatches:
    """The items handed out and not yet taken by a decided step."""

    def __init__(self, accumulation_steps: int, events: EventLog, rank: int) -> None:
        self._k = accumulation_steps
        self._events = events
        self._rank = rank
        self._items: deque[tuple[Any, RngSnapshot | None, int]] = deque()
        self._ahead: int | None = None
        """How many items the loop holds ahead at a decision (set by the first step)."""
        self.mismatch = False
        """The loop's batches per step did not match ``accumulation_steps`` (said once)."""

    def handed_out(self, batch: Any, rng: RngSnapshot | None, position: int) -> None:
        """``watch()`` yielded ``batch``, item ``position`` of the iterable (``rng``: states
        taken before it, or None)."""
        self._items.append((batch, rng, position))
        if len(self._items) > MAX_AHEAD + self._k:
            self._items.popleft()

    def step(self) -> list[Any]:
        """The micro-batches of the step being decided (the first ``k`` waiting)."""
        return [batch for batch, _, _ in list(self._items)[: self._k]]

    def step_positions(self) -> list[int]:
        """The positions in the iterable of the step's micro-batches (``step``'s items)."""
        return [position for _, _, position in list(self._items)[: self._k]]

    def first_position(self) -> int | None:
        """Position of the oldest item waiting: the first batch of the step in progress
        (None: none handed out since the last decided step)."""
        return self._items[0][2] if self._items else None

    def first_batch(self) -> tuple[Any] | None:
        """The oldest item waiting (``first_position``'s), in a 1-tuple (None: none)."""
        return (self._items[0][0],) if self._items else None

    def ahead_position(self) -> int | None:
        """Position of the first item beyond the step being decided: a batch the loop fetched
        ahead and has not trained on (None: the loop holds none)."""
        return self._items[self._k][2] if len(self._items) > self._k else None

    def step_rng(self) -> dict[str, Any] | None:
        """RNG states taken when the step's first micro-batch was handed out, if any."""
        rng = self.step_rng_snapshot()
        return rng.state() if rng is not None else None

    def step_rng_snapshot(self) -> RngSnapshot | None:
        """``step_rng`` as taken (not yet turned into a dict)."""
        return self._items[0][1] if self._items else None

    def taken(self, step: int) -> None:
        """Step ``step`` was decided: its micro-batches leave; a mismatch is said once."""
        waiting = len(self._items)
        for _ in range(min(waiting, self._k)):
            self._items.popleft()
        ahead = len(self._items)
        if waiting < self._k:
            self._report(step, "fewer", waiting)
        elif self._ahead is None:
            self._ahead = ahead
        elif ahead > self._ahead:
            self._report(step, "more", self._k + ahead - self._ahead)

    def _report(self, step: int, kind: str, taken: int) -> None:
        if self.mismatch:
            return
        self.mismatch = True
        self._events.write(
            "batch_mismatch",
            step,
            accumulation_steps=self._k,
            loop_takes=kind,
            batches=taken,
        )
        if self._rank == 0:
            logger.warning(
                "trainguard: step %d used %s than accumulation_steps=%d batches from watch() "
                "(%d); a capture may hold other batches than the step ran. Set "
                "Guard(accumulation_steps=...) to the number of batches the loop takes per "
                "optimizer step, and call check() once per optimizer step",
                step,
                kind,
                self._k,
                taken,
            )
