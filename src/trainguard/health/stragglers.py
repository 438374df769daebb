"""Which rank slows the job: a rule over the per-rank times every rank already agreed on.

Each decided step brings every rank's *data* seconds (waiting for its loader inside
``watch()``) and *compute* seconds (its own forward passes, no waiting for other ranks; see
``health.timing``), identical on every rank because they ride the step's all-reduce. Per
phase, the watch keeps the last ``straggler_window`` steps (after ``straggler_warmup``
steps that are not judged) and, once the window is full, judges at every step:

- the *reference*: the median rank's median over the window (the lower middle one for an
  even number of ranks, so that of two ranks the faster is the reference): a typical step;
- each rank's *lower quartile* over the window (``SLOW_SHARE``): the time it exceeds in
  3/4 of the steps. A straggler is slow at (nearly) every step; a busy machine slows a
  random rank at random steps. On two shared cores running four ranks (load 11) a rank's
  *median* over 20-40 steps reached 1.5-3.8x the reference in 6 to 8 runs of 10 healthy
  runs; its lower quartile over 40 steps stayed under both floors in all 10
  (``docs/health.md``);
- a rank is a straggler when that quartile is at least ``straggler_slowdown`` x the reference
  **and** at least ``straggler_min_lost`` seconds above it. The first floor ignores the
  jitter of long steps, the second the large ratios of tiny times (a loader that takes 30 us
  instead of 10 us costs nobody anything).

What is reported is what was judged: ``slowdown`` (the rank's quartile over the reference)
and ``lost_per_step`` (its quartile minus the reference: what every other rank waits for it,
at least, in 3/4 of the steps; for a rank slow at every step, its median minus the
reference); ``per_rank`` adds each named rank's median.

A rank once named stays named while it is at least half as far above both floors
(hysteresis), so a rank hovering at the threshold does not flap. The verdict (the set of
named ranks) is reported only when it changes: a ``straggler`` event on every rank (``ranks``,
``phase``, ``slowdown``, ``lost_per_step``, ``step``, ``per_rank`` details; ``ranks: []`` and
``recovered`` when it is over) and one warning line on rank 0. The same numbers on every rank
give the same verdict on every rank, with no communication of its own.

Cost per step: a row written into a small ring tensor per phase and, once the window is full,
one ``sort`` of each rank's window (every step up to 128 ranks, every ``world // 128`` steps
past that; measured by the straggler cost benchmark at 3c1ebd7).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from trainguard.config import HealthConfig
from trainguard.events import EventLog

logger = logging.getLogger(__name__)

PHASES = ("data", "compute")
WINDOW = 40
"""Steps over which a rank must be slow, in 3/4 of them, before it is named (40: a busy
machine's scheduling noise stays under the floors; docs/health.md)."""
MIN_LOST = 0.01
"""Seconds a step the job must wait for a rank before it is named a straggler."""
_WHAT = {"data": "waiting for its data", "compute": "in its own compute (forward)"}
HYSTERESIS = 0.5
"""A named rank stays named while it is this fraction of the way above both floors."""
SLOW_SHARE = 0.75
"""A rank must be slow in this share of the window's steps (its lower quartile is judged)."""
RANKS_PER_JUDGED_STEP = 128
"""Past this many ranks the window is judged every ``world // 128`` steps, not every step:
the per-rank medians cost about 0.5 us per rank (the straggler cost benchmark at
3c1ebd7)."""
SMALL_WORLD = 16
"""Up to this many ranks a window is kept in Python lists and the usual step (nobody near a
floor, nobody named) is judged on host floats, with no tensor op: torch's per-op overhead
made the judgement of 2 ranks cost about 190 us a step (``benchmarks/fixed_cost.py``)."""


@dataclass(frozen=True)
class Verdict:
    """One phase's judgement of a full window."""

    ranks: tuple[int, ...]
    """The named ranks, ascending."""
    lows: Tensor
    """Every rank's judged seconds: its lower quartile over the window (float64)."""
    medians: Tensor
    """Every rank's median seconds over the window."""
    reference: float
    """The median rank's median seconds."""

    def seconds(self, rank: int) -> float:
        """What ``rank`` takes in 3/4 of the window's steps, at least."""
        return float(self.lows[rank])

    def slowdown(self, rank: int) -> float:
        """``seconds(rank)`` over the reference (``inf`` when the reference is 0)."""
        seconds = self.seconds(rank)
        if self.reference > 0.0:
            return seconds / self.reference
        return float("inf") if seconds > 0.0 else 1.0

    def lost(self, rank: int) -> float:
        """Seconds per step the job waits for ``rank``, at least, in 3/4 of the steps."""
        return max(self.seconds(rank) - self.reference, 0.0)


def judge(
    medians: Sequence[float] | Tensor,
    slowdown: float,
    min_lost: float,
    named: frozenset[int] = frozenset(),
    lows: Sequence[float] | Tensor | None = None,
) -> Verdict:
    """The ranks whose ``lows`` (lower quartiles; default: the medians) are ``>= slowdown`` x
    the reference (the median of ``medians``) and ``>= min_lost`` above it; ranks in ``named``
    (named before) are held to floors ``HYSTERESIS`` of the way down."""
    values = torch.as_tensor(medians, dtype=torch.float64)
    low = values if lows is None else torch.as_tensor(lows, dtype=torch.float64)
    reference = float(values.median())  # the lower middle one for an even number of ranks
    if quiet(reference, float(low.max()), slowdown, min_lost):
        return Verdict((), low, values, reference)  # the usual case: nobody near a floor
    ratio = torch.full_like(low, slowdown)
    lost = torch.full_like(low, min_lost)
    named = frozenset(r for r in named if 0 <= r < len(low))
    if named:
        held = torch.tensor(sorted(named), dtype=torch.long)
        ratio[held] = 1.0 + (slowdown - 1.0) * HYSTERESIS
        lost[held] = min_lost * HYSTERESIS
    above = low - reference
    slow = (low >= ratio * reference) & (above >= lost) & (above > 0.0)
    ranks: list[int] = slow.nonzero().flatten().tolist()
    return Verdict(tuple(ranks), low, values, reference)


def quiet(reference: float, top: float, slowdown: float, min_lost: float) -> bool:
    """Whether the slowest rank's judged seconds ``top`` are below even the held (loosest)
    floors over ``reference``: then nobody is named, whoever was named before."""
    loosest = max(1.0 + (slowdown - 1.0) * HYSTERESIS, 1.0) * reference
    return top <= reference or top < loosest or top - reference < min_lost * HYSTERESIS


class PhaseWindow:
    """The last ``size`` steps of one phase's per-rank seconds (a ring tensor, ranks x steps:
    each rank's steps contiguous, so sorting them is one cheap ``sort`` along a row; up to
    ``SMALL_WORLD`` ranks a list per rank instead, see ``host_stats``)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ring: Tensor | None = None
        self._rows: list[list[float]] | None = None
        self._count = 0

    def add(self, times: Sequence[float]) -> None:
        if len(times) <= SMALL_WORLD:
            rows = self._rows
            if rows is None or len(rows) != len(times):  # first step (or a new world)
                rows = self._rows = [[0.0] * self.size for _ in times]
                self._ring = None
                self._count = 0
            slot = self._count % self.size
            for ranks_row, seconds in zip(rows, times, strict=True):
                ranks_row[slot] = seconds
            self._count += 1
            return
        self._rows = None
        ring = self._ring
        if ring is None or ring.shape[0] != len(times):  # first step (or a new world)
            ring = self._ring = torch.zeros(len(times), self.size, dtype=torch.float64)
            self._count = 0
        row = torch.frombuffer(array("d", times), dtype=torch.float64)  # no per-float boxing
        ring[:, self._count % self.size] = row
        self._count += 1

    @property
    def full(self) -> bool:
        return self._count >= self.size

    def stats(self) -> tuple[Tensor, Tensor]:
        """Each rank's median and lower quartile (``SLOW_SHARE``) over the window: the values
        it exceeds in half and in ``SLOW_SHARE`` of the steps (the lower one when between)."""
        found = self.host_stats()
        if found is not None:
            medians, lows = found
            return torch.tensor(medians, dtype=torch.float64), torch.tensor(
                lows, dtype=torch.float64
            )
        assert self._ring is not None
        ordered = self._ring.sort(dim=1).values
        median = (self.size - 1) // 2
        low = int((1.0 - SLOW_SHARE) * (self.size - 1))
        return ordered[:, median], ordered[:, low]

    def host_stats(self) -> tuple[list[float], list[float]] | None:
        """``stats()`` as host floats for a window kept in lists (None: a ring tensor)."""
        if self._rows is None:
            return None
        median = (self.size - 1) // 2
        low = int((1.0 - SLOW_SHARE) * (self.size - 1))
        ordered = [sorted(row) for row in self._rows]
        return [row[median] for row in ordered], [row[low] for row in ordered]


@dataclass
class PhaseState:
    window: PhaseWindow
    named: frozenset[int] = field(default_factory=frozenset)


class StragglerWatch:
    """Fed each decided step's per-rank data and compute seconds (identical on every rank)."""

    def __init__(self, config: HealthConfig, events: EventLog, rank: int) -> None:
        self._config = config
        self._events = events
        self._rank = rank
        self._enabled = config.detect_stragglers
        self._seen = 0
        self._phases = {phase: PhaseState(PhaseWindow(WINDOW)) for phase in PHASES}

    @property
    def current(self) -> dict[str, list[int]]:
        """The ranks named now, per phase (empty lists: none)."""
        return {phase: sorted(state.named) for phase, state in self._phases.items()}

    def observe(self, step: int, data_times: list[float], compute_times: list[float]) -> None:
        """One decided step's per-rank times (the same lists on every rank). A world of one
        is not judged: a rank's lower quartile never exceeds its own median (the reference),
        so no verdict could name it; its windows stay empty."""
        if not self._enabled or len(data_times) < 2:
            return
        self._seen += 1
        if self._seen <= self._config.straggler_warmup:
            return
        due = self._seen % max(1, len(data_times) // RANKS_PER_JUDGED_STEP) == 0
        for phase, times in (("data", data_times), ("compute", compute_times)):
            self._observe_phase(step, phase, times, due)

    def _observe_phase(self, step: int, phase: str, times: list[float], due: bool) -> None:
        state = self._phases[phase]
        state.window.add(times)
        if not (due and state.window.full):
            return
        config = self._config
        host = state.window.host_stats()
        if host is not None and not state.named:  # small worlds: the usual step, no tensor
            medians_now, lows_now = host
            reference = sorted(medians_now)[(len(medians_now) - 1) // 2]  # as Tensor.median
            slowdown, min_lost = config.straggler_slowdown, MIN_LOST
            if quiet(reference, max(lows_now), slowdown, min_lost):
                return
        medians, lows = state.window.stats()
        slowdown, min_lost = config.straggler_slowdown, MIN_LOST
        verdict = judge(medians, slowdown, min_lost, state.named, lows)
        named = frozenset(verdict.ranks)
        if named != state.named:
            self._report(step, phase, verdict, previous=state.named)
            state.named = named

    def _report(self, step: int, phase: str, verdict: Verdict, previous: frozenset[int]) -> None:
        about = verdict.ranks or tuple(sorted(previous))  # recovery: how the named ones are now
        slowdown = max(verdict.slowdown(r) for r in about)
        lost = max(verdict.lost(r) for r in about)
        per_rank = [
            {
                "rank": r,
                "seconds": verdict.seconds(r),
                "median_seconds": float(verdict.medians[r]),
                "slowdown": verdict.slowdown(r),
                "lost_per_step": verdict.lost(r),
            }
            for r in about
        ]
        self._events.write(
            "straggler",
            step,
            ranks=list(verdict.ranks),
            phase=phase,
            slowdown=slowdown,
            lost_per_step=lost,
            reference_seconds=verdict.reference,
            window=WINDOW,
            per_rank=per_rank,
            recovered=sorted(previous - set(verdict.ranks)),
        )
        if self._rank == 0:
            window = WINDOW
            logger.warning("%s", _message(step, phase, verdict, previous, window, lost))


def _message(
    step: int,
    phase: str,
    verdict: Verdict,
    previous: frozenset[int],
    window: int,
    lost: float,
) -> str:
    ranks = list(verdict.ranks)
    if not ranks:
        now = ", ".join(f"{verdict.slowdown(r):.2f}x" for r in sorted(previous))
        return (
            f"trainguard: step {step}: straggler over: ranks {sorted(previous)} no longer slow "
            f"{_WHAT[phase]} ({now} the median rank in 3/4 of the last {window} steps)"
        )
    who = f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {ranks} are"
    slowest = max(ranks, key=verdict.seconds)
    return (
        f"trainguard: step {step}: straggler: {who} slow {_WHAT[phase]}: "
        f"{verdict.slowdown(slowest):.1f}x the median rank ({verdict.seconds(slowest):.4f} s vs "
        f"{verdict.reference:.4f} s per step in 3/4 of the last {window} steps); the job loses "
        f"about {lost:.4f} s per step"
    )
