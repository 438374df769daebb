"""The batch stream behind ``Guard.watch()``: prefetch, uneven-data agreement, step batches.

The stream keeps the next optimizer step's micro-batches fetched ahead (references, never
copies), so when ``check()`` runs it already knows whether this rank has another full step.
That bit rides on the check's all-reduce; when any rank is out of data every rank ends its
loop after the same step, with an ``uneven_data`` event, instead of hanging in the next
collective.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from trainguard.consensus import Agreement, Consensus
from trainguard.events import EventLog
from trainguard.progress import Progress
from trainguard.rng import rng_state

logger = logging.getLogger(__name__)


class BatchStream:
    """Iterates ``iterable`` in steps of ``accumulation_steps`` micro-batches."""

    def __init__(
        self,
        iterable: Iterable[Any],
        accumulation_steps: int,
        consensus: Consensus,
        progress: Progress,
        events: EventLog,
        step_of: Callable[[], int],
    ) -> None:
        self._iterable = iterable
        self._k = accumulation_steps
        self._consensus = consensus
        self._progress = progress
        self._events = events
        self._step_of = step_of
        self._queue: deque[Any] = deque()
        self._exhausted = False
        self._yielded = 0
        self._agreement: Agreement | None = None
        self.current: list[Any] = []
        """Micro-batches of the step in progress (references, not copies)."""
        self.current_rng: dict[str, Any] | None = None
        """RNG states taken before the step's first micro-batch was handed out."""

    @property
    def has_next_step(self) -> bool:
        """This rank holds the next step's micro-batches already."""
        return len(self._queue) >= self._k

    @property
    def batches_seen(self) -> int:
        return self._yielded + len(self._queue)

    def agreed(self, agreement: Agreement) -> None:
        """``check()`` hands over its agreement: the stream reads the ranks' data state from it."""
        self._agreement = agreement

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self._iterable)
        self._fill(iterator, self._k)
        if self._stop(self._consensus.exchange_has_next(self.has_next_step, self.batches_seen)):
            return
        while True:
            self.current = []
            self._agreement = None
            for _ in range(self._k):
                self._fill(iterator, self._k + 1)
                batch = self._queue.popleft()
                if not self.current:
                    self.current_rng = rng_state()
                self.current.append(batch)
                self._yielded += 1
                self._progress.enter("step")
                yield batch
            agreement = self._agreement
            if agreement is None:  # the loop did not call check(): agree here instead
                agreement = self._consensus.exchange_has_next(self.has_next_step, self.batches_seen)
            if self._stop(agreement):
                return

    def _fill(self, iterator: Iterator[Any], size: int) -> None:
        while not self._exhausted and len(self._queue) < size:
            self._progress.enter("data")
            try:
                self._queue.append(next(iterator))
            except StopIteration:
                self._exhausted = True

    def _stop(self, agreement: Agreement) -> bool:
        exhausted = agreement.exhausted_ranks
        if not exhausted:
            return False
        if len(exhausted) < self._consensus.world_size:
            self._events.write(
                "uneven_data",
                self._step_of(),
                batches=agreement.batches,
                exhausted_ranks=exhausted,
                dropped=len(self._queue),
            )
            if self._consensus.rank == 0:
                logger.warning(
                    "trainguard: ranks %s ran out of data (batches per rank: %s); every rank "
                    "stops after step %d",
                    exhausted,
                    agreement.batches,
                    self._step_of() - 1,
                )
        self._queue.clear()
        self.current = []
        return True
