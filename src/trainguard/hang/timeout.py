"""The hang timeout: fixed, or learned from the run (``hang_timeout=None``), and the
intervals derived from it.

The learning rule (``hang_timeout=None``):

* **Grace.** Until this rank has completed ``WARMUP_STEPS`` optimizer steps since the
  watchdog started (compilation, autotuning, the first collectives, a resumed run's first
  steps), the timeout is ``GRACE_S`` (600 s); so it is while a later ``watch()`` pass
  fetches its first batches (``Progress.pass_start``: a DataLoader starting its workers at
  each epoch), a stretch the learner is not fed either.
* **Learned.** After that the watchdog measures every stretch of time in which the local
  loop made no progress (the ``Progress`` beat counter did not change: fetching a batch,
  forward/backward, the check's all-reduce), outside user phases and after the warm-up.
  The timeout is ``max(FLOOR_S, FACTOR * longest stretch seen)``: 30 s at least, ten times
  the slowest healthy stretch so far. It only grows, so a slow stretch that comes back
  every thousand steps is not taken for a hang once it has been seen.
* Every rank publishes its value with its heartbeat and a hang is declared only after the
  largest of them, so all ranks use the most patient rank's timeout.

Derived intervals: a rank whose heartbeat counter stops for ``dead_after(timeout)`` is dead
or frozen (its watchdog thread no longer runs); the watchdog ticks every
``tick_interval(timeout)``; a frozen interpreter dumps its stacks after
``frozen_after(timeout)`` (faulthandler fallback); a stalled rank publishes its collective
after ``record_after(timeout)``.

``StallMeter`` measures the stretches without progress that the learner is fed.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.hang.progress import Progress

GRACE_S = 600.0
"""Timeout while the first ``WARMUP_STEPS`` steps run (compilation and warm-up)."""

FLOOR_S = 30.0
"""The learned timeout is never below this."""

FACTOR = 10.0
"""The learned timeout is this many times the longest healthy stretch without progress."""

WARMUP_STEPS = 2
"""Optimizer steps, counted from the watchdog's start, that run under the grace timeout."""

DEAD_AFTER_MIN_S = 2.0
DEAD_AFTER_MAX_S = 60.0


def dead_after(timeout: float) -> float:
    """Seconds without a new heartbeat after which a rank counts as dead or frozen.

    The heartbeat comes from the watchdog thread, not from training progress, so it is
    capped at ``DEAD_AFTER_MAX_S`` even when the hang timeout is long."""
    return min(max(timeout, DEAD_AFTER_MIN_S), DEAD_AFTER_MAX_S)


def tick_interval(timeout: float) -> float:
    """Seconds between two watchdog ticks: a tenth of ``dead_after``, within [0.1, 1]."""
    return min(max(dead_after(timeout) / 10.0, 0.1), 1.0)


def record_after(timeout: float) -> float:
    """Seconds without local progress after which a rank publishes the collective it waits
    in with its heartbeat: a quarter of the timeout (at least two ticks), so every stalled
    rank's record is in the store well before a watcher declares the hang. A learned timeout
    is 10 x the longest healthy stall, so a healthy run never gets there."""
    return max(timeout / 4.0, 2.0 * tick_interval(timeout))


def dump_interval(timeout: float) -> float:
    """Seconds between two full flight-recorder dumps of a stalled rank (tens of ms each)."""
    return timeout / 8.0


def frozen_after(timeout: float) -> float:
    """Seconds without a watchdog tick after which faulthandler dumps the stacks and exits.

    Slightly later than the peers' ``dead_after``, so the peers report the frozen rank
    first and a thread that was merely starved for a moment is not ended."""
    return dead_after(timeout) + 2.0 * tick_interval(timeout) + 1.0


@dataclass
class TimeoutLearner:
    """The hang timeout of one rank: ``fixed`` seconds, or learned (``fixed=None``)."""

    fixed: float | None = None
    grace: float = GRACE_S
    floor: float = FLOOR_S
    factor: float = FACTOR
    warmup_steps: int = WARMUP_STEPS
    longest_stall: float = 0.0
    """Longest healthy stretch without progress seen after the warm-up (seconds)."""

    def observe(self, stall: float, steps_done: int) -> None:
        """A stretch of ``stall`` seconds without progress ended (outside user phases)."""
        if steps_done >= self.warmup_steps:
            self.longest_stall = max(self.longest_stall, stall)

    def rule(self, steps_done: int) -> str:
        if self.fixed is not None:
            return "fixed"
        return "grace" if steps_done < self.warmup_steps else "learned"

    def value(self, steps_done: int, pass_start: bool = False) -> float:
        """The timeout in seconds after ``steps_done`` steps since the watchdog started;
        ``pass_start``: a ``watch()`` pass is fetching its first batches (grace too)."""
        if self.fixed is not None:
            return self.fixed
        if steps_done < self.warmup_steps or pass_start:
            return self.grace
        return max(self.floor, self.factor * self.longest_stall)


class StallMeter:
    """Measures the local loop's stretches without progress (``Progress.beats`` unchanged)
    and feeds each finished one to the learner, unless part of it was spent in a user phase
    or outside the loop (``init``, ``done``, ``closed``), it began during the warm-up, or it
    ended or began with busy beats alone (work on another module: ``hang/busy.py``; a busy
    beat beside the loop's own, a module called on the batch as the loop resumes, changes
    nothing)."""

    def __init__(self, learner: TimeoutLearner, now: float) -> None:
        self.learner = learner
        self._last_beats = -1
        self._last_busy = 0
        self._last_change = now
        self._from_steps = 0
        self._excluded = True

    def stalled_for(self, now: float) -> float:
        """Seconds since the loop last made progress, as of the last ``observe``."""
        return now - self._last_change if self._last_beats >= 0 else 0.0

    def observe(self, progress: Progress, steps_done: int, now: float) -> None:
        """One look at the loop (every watchdog tick)."""
        excluded = (
            progress.in_user_phase
            or progress.pass_start
            or progress.phase in ("init", "done", "closed")
        )
        if progress.beats == self._last_beats:
            self._excluded = self._excluded or excluded
            return
        # only busy beats since the last look: work on another module, not the loop's own
        busy = progress.busy_beats - self._last_busy == progress.beats - self._last_beats
        counted = self._last_beats >= 0 and not self._excluded and not busy
        if counted and self._from_steps >= self.learner.warmup_steps:
            self.learner.observe(now - self._last_change, steps_done)
        self._last_beats = progress.beats
        self._last_busy = progress.busy_beats
        self._last_change = now
        self._from_steps = steps_done
        self._excluded = excluded or busy
