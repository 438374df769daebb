"""The batch stream behind ``Guard.watch()``: prefetch, uneven-data agreement, step batches.

The stream fetches ``lookahead`` optimizer steps ahead (references, never copies). Each
step's report carries whether this rank's iterator is used up and how many batches it has
fetched; the agreement therefore tells every rank how many steps the shortest rank can still
take. Every rank ends its loop after the same step, with an ``uneven_data`` event, instead of
hanging in the next collective.

Why the rule is safe: a rank that is not used up when it reports for step ``s`` has fetched
at least ``(s + 1 + lookahead) * k`` batches. The decision after step ``t`` may use a report
up to ``lag = lookahead - 1`` steps old (the sync-free ``guard.step()`` reads its flags a step
late), and still every rank not yet used up is known to hold step ``t + 1``.

Recovery keeps the rule: batches dropped from the stream (skipped after a rollback, or
consumed before a resume) are never counted in ``batches_seen``, and a drop forgets the last
agreement so that the next step agrees afresh (every rank drops at the same point: the
rollback is agreed). ``position`` counts every item taken from the iterable, dropped or not.

Lengths at the start: the agreement when the loop starts (one per ``watch()``, which runs in
any case) also carries each rank's ``len(iterable)`` in its otherwise unused loss column, so
ranks whose number of batches differs are reported (``uneven_lengths``) before the first
step, at no extra collective and no per-step cost.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.capture.rng import RngSnapshot
from trainguard.capture.sampler_indices import SamplerIndices
from trainguard.events import EventLog
from trainguard.hang.progress import Progress
from trainguard.health.timing import StepTimer
from trainguard.step.batches import StepBatches
from trainguard.step.consensus import DEVICE_COLUMNS, Consensus
from trainguard.step.refilled_batches import RefillProbe, refill_reporter
from trainguard.step.types import Agreement, LocalReport, SamplerDraws

logger = logging.getLogger(__name__)


def iterable_length(iterable: Any) -> int:
    """``len(iterable)`` (batches, for a DataLoader), or -1 when it has none."""
    try:
        return len(iterable)
    except (TypeError, NotImplementedError):  # an iterator, a generator, no __len__
        return -1


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
        lookahead: int = 1,
        start_position: int = 0,
        skip_positions: frozenset[int] = frozenset(),
        on_step_start: Callable[[], None] | None = None,
        first_position: int = 0,
        on_handout: Callable[[], None] | None = None,
        on_fetch: Callable[[int], None] | None = None,
        clock: StepTimer | None = None,
    ) -> None:
        self._iterable = iterable
        self._k = accumulation_steps
        self._lookahead = lookahead
        self._consensus = consensus
        self._progress = progress
        self._events = events
        self._step_of = step_of
        self._queue: deque[tuple[int, Any]] = deque()
        # Items taken from the iterable, dropped ones included; a restored loader (resume of a
        # StatefulDataLoader) starts at ``first_position``. ``on_fetch(p)`` runs before item p.
        self._taken = first_position
        self._on_fetch = on_fetch
        self._clock = clock
        """Times each fetch from the loader (``health.timing``: a rank's data time)."""
        self._start_position = start_position
        self._skip_positions = skip_positions
        self._on_step_start = on_step_start
        self._on_handout = on_handout
        """Recovery's hand-out of a step's first batch (states at a failure), or None."""
        self._to_drop = 0
        self.dropped: list[int] = []
        """Positions (in the iterable) of the batches dropped so far, in order."""
        self._exhausted = False
        self._yielded = 0
        self._agreement: Agreement | None = None
        self._agreement_step = -1
        self._in_step = -1
        self._refills: RefillProbe | None = RefillProbe(
            (lookahead + 1) * accumulation_steps + 1,
            refill_reporter(events, consensus.rank, step_of),
        )
        """Probes the first batches for an iterable that refills its tensors (``refill.py``)."""
        self.unchecked = StepBatches(accumulation_steps, events, consensus.rank)
        """The batches handed out and not yet decided, in order: the checked step's are the
        first ``accumulation_steps`` of them, however far the loop fetched ahead."""
        self.sampler_indices: SamplerIndices | None = None
        """The dataset indices a ``DataLoader``'s sampler drew for each item of the pass
        (``capture/sampler_indices.py``), None for other iterables."""
        self.start_at_yield = True
        """Start the step when its first batch is handed out (the RNG states, and
        recovery's step boundary): the fallback while no forward hook records the step's
        start (``step_start.StepStart``)."""

    def step_draws(self) -> SamplerDraws | None:
        """What gives, per micro-batch of the step being decided, the dataset indices its
        sampler drew, read only when wanted (a bad step); None: no sampler followed."""
        found = self.sampler_indices
        if found is None:
            return None
        return functools.partial(found.of_positions, self.unchecked.step_positions())

    @property
    def exhausted(self) -> bool:
        return self._exhausted

    @property
    def position(self) -> int:
        """Position in the iterable of the next batch to hand out (dropped ones counted)."""
        return self._queue[0][0] if self._queue else self._taken

    @property
    def step_position(self) -> int:
        """Position of the first batch of the step in progress: handed out already (a loop
        that fetches ahead took it during the step before), else the next to hand out."""
        first = self.unchecked.first_position()
        return self.position if first is None else first

    @property
    def step_batch(self) -> Any:
        """The first batch of the step in progress, the one at ``step_position`` (None when
        neither handed out nor fetched)."""
        first = self.unchecked.first_batch()
        if first is not None:
            return first[0]
        return self._queue[0][1] if self._queue else None

    @property
    def untrained_position(self) -> int:
        """During a ``check()``: the first position the loop has not trained on, a batch it
        fetched ahead and holds (it trains the next step on it), else the next to hand out."""
        ahead = self.unchecked.ahead_position()
        return self.position if ahead is None else ahead

    def drop_next(self, count: int) -> None:
        """Drop the next ``count`` batches (fetched or not); call on every rank alike."""
        while count > 0 and self._queue:
            self.dropped.append(self._queue.popleft()[0])
            count -= 1
        self._to_drop += count
        self._agreement = None  # the counts changed: agree afresh before the next step

    @property
    def batches_seen(self) -> int:
        return self._yielded + len(self._queue)

    def agreed(self, agreement: Agreement, steps_ago: int = 0) -> None:
        """The guard hands over a step's agreement: the step in progress, or ``steps_ago``."""
        step = self._in_step - steps_ago
        if step >= self._agreement_step:  # ``_set_agreement``, without the call (every step)
            self._agreement = agreement
            self._agreement_step = step

    def _set_agreement(self, agreement: Agreement, step: int) -> None:
        if step >= self._agreement_step:
            self._agreement = agreement
            self._agreement_step = step

    def __iter__(self) -> Iterator[Any]:
        self._progress.pass_start = True  # the learned hang timeout's grace (hang/timeout.py)
        try:
            iterator = iter(self._iterable)
            self.sampler_indices = SamplerIndices.follow(iterator, self._taken)
            self._fill(iterator, (self._lookahead + 1) * self._k)
        finally:
            self._progress.pass_start = False
        self._set_agreement(self._exchange_at_start(), -1)
        step = 0
        while not self._stop_before(step):
            self._in_step = step
            for micro in range(self._k):
                self._fill(iterator, self._lookahead * self._k + 1)
                if not self._queue:  # dropped after a rollback: the data ran out
                    break
                rng = None
                if micro == 0 and self._on_handout is not None:
                    self._on_handout()
                if micro == 0 and self.start_at_yield:
                    if self._on_step_start is not None:
                        self._on_step_start()  # recovery: snapshot at the step boundary
                    rng = RngSnapshot.take()
                position, batch = self._queue.popleft()
                self.unchecked.handed_out(batch, rng, position)
                self._yielded += 1
                self._progress.enter("step")
                yield batch
            step += 1

    def _exchange(self) -> Agreement:
        return self._consensus.exchange_data_state(self._exhausted, self.batches_seen)

    def _exchange_at_start(self) -> Agreement:
        """The start's agreement, with each rank's ``len(iterable)`` (-1: no ``len``) in the
        loss column, which the standalone agreement does not otherwise use."""
        values = torch.zeros(DEVICE_COLUMNS, dtype=torch.float64)
        values[0] = float(iterable_length(self._iterable))
        report = LocalReport(values, exhausted=self._exhausted, batches=self.batches_seen)
        agreement = self._consensus.agree(report, sum_grad_norms=False)
        self._report_lengths([int(length) for length in agreement.losses])
        return agreement

    def _report_lengths(self, lengths: list[int]) -> None:
        """An ``uneven_lengths`` event on every rank when the ranks' lengths differ."""
        known = [n for n in lengths if n >= 0]
        if len(set(known)) < 2:
            return
        shortest = min(known)
        self._events.write(
            "uneven_lengths",
            self._step_of(),
            lengths=[n if n >= 0 else None for n in lengths],
            shortest_ranks=[r for r, n in enumerate(lengths) if n == shortest],
            steps_at_most=shortest // self._k,
        )
        if self._consensus.rank == 0:
            logger.warning(
                "trainguard: the ranks' loaders differ in length (batches per rank: %s); "
                "every rank stops together after at most %d steps, when the shortest runs out",
                lengths,
                shortest // self._k,
            )

    def _fill(self, iterator: Iterator[Any], size: int) -> None:
        while not self._exhausted and len(self._queue) < size:
            self._progress.enter("data")
            if self._on_fetch is not None:
                self._on_fetch(self._taken)
            if self._clock is not None:
                self._clock.data_started()
            try:
                item = next(iterator)
            except StopIteration:
                self._exhausted = True
                break
            finally:
                if self._clock is not None:
                    self._clock.data_ended()
            position, self._taken = self._taken, self._taken + 1
            if position < self._start_position or position in self._skip_positions:
                continue
            refills = self._refills
            if refills is not None:  # the first batches, or an iterable that refills its own
                item = refills.take(item)
                if refills.done:
                    self._refills = None
            if self._to_drop > 0:
                self._to_drop -= 1
                self.dropped.append(position)
                continue
            self._queue.append((position, item))

    def _stop_before(self, step: int) -> bool:
        """Whether every rank stops before ``step``, from an agreement at most a lag old."""
        lag = self._lookahead - 1
        if self._agreement is None or self._agreement_step < step - 1 - lag:
            # The loop did not call check() for the last step(s): agree here instead.
            self._set_agreement(self._exchange(), step - 1)
        agreement = self._agreement
        assert agreement is not None  # set just above
        if not agreement.exhausted_ranks:  # the usual step: no rank ran out
            return False
        available = agreement.steps_available(self._k)
        if step < available:
            return False
        self._report_end(agreement, step)
        return True

    def _report_end(self, agreement: Agreement, step: int) -> None:
        dropped = len(self._queue)
        everyone_done = len(agreement.exhausted_ranks) == self._consensus.world_size
        totals = {b // self._k for b in agreement.batches}
        if everyone_done and len(totals) == 1:
            self._report_partial_step(step, dropped)
        else:
            self._events.write(
                "uneven_data",
                self._step_of(),
                batches=agreement.batches,
                exhausted_ranks=agreement.exhausted_ranks,
                steps=step,
                dropped=dropped,
            )
            if self._consensus.rank == 0:
                logger.warning(
                    "trainguard: ranks %s ran out of data (batches fetched per rank: %s); "
                    "every rank stops after %d steps",
                    agreement.exhausted_ranks,
                    agreement.batches,
                    step,
                )
        self._queue.clear()

    def _report_partial_step(self, step: int, dropped: int) -> None:
        """Every rank ran out with the same steps: the batches left over, fewer than
        ``accumulation_steps``, make no step and are not trained; said (``partial_step``)."""
        if dropped == 0:
            return
        self._events.write(
            "partial_step", self._step_of(), steps=step, dropped=dropped, accumulation_steps=self._k
        )
        if self._consensus.rank == 0:
            logger.warning(
                "trainguard: the pass ended %d batch(es) short of a step of %d "
                "(accumulation_steps): they were not trained; make the loader's length a "
                "multiple of accumulation_steps to train every batch",
                dropped,
                self._k,
            )


@dataclass
class StreamSlot:
    """The loop's current ``watch()`` stream (None: no ``watch()`` yet): the guard puts a new
    one here at every ``watch()``, the parts that read a step's batches hold the slot (a
    plain object: never a closure over the guard, which would keep a dropped guard alive)."""

    current: BatchStream | None = None
