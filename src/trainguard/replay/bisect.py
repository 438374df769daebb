"""Find the samples whose presence makes a (micro-)batch non-finite, by bisection.

The model: a sub-batch is bad when it holds at least one culprit sample. Each round halves
the remaining samples, keeping a half that is still bad, down to one sample; when neither
half is bad alone it splits finer and drops parts (delta debugging), down to a set of
samples that are bad only together. The round's find is removed and the rest is run again:
when it is finite the culprits are found; when it is still bad another round starts.

First, by exclusion: the samples are halved by *removing* a half and running the rest, down to
one sample whose removal makes the batch finite (and which is bad on its own; when a run of
one sample raises, as BatchNorm in training mode does, bad with each half of the other samples
instead: a sample bad only together with another one is bad with one half only). The batches
run stay at least half the batch, so a loss that normalises over the batch (an advantage
divided by the batch's std, a batch-mean baseline) cannot go non-finite for want of samples,
as the sub-batches of the search below do at one or two samples: the std of one sample is
NaN whichever sample it is, and that search then took every sample for a culprit (or blamed
the first one it tried). When no single sample's removal fixes the batch (several culprits,
samples bad only together, a batch-level cause), the search below runs as before.

A cause that belongs to the batch as a whole (a class with no sample, a statistic over the
batch) makes every sub-batch bad, so "culprits" would be every sample. The search stops and
returns ``[]`` (no single sample to blame) when, after the first round, three other samples
spread over the batch are each bad alone, or when culprits would exceed half the batch.
When the run budget (64 runs) is spent first it claims nothing (``complete=False``). A run
that raises (``bad`` returns None: e.g. BatchNorm with one sample) counts as fine, except in
the check of the sample found by exclusion (above).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class Bisection:
    culprits: list[int]
    """Positions to blame; empty for a batch-level cause (or when nothing was bad)."""
    runs: int
    batch_level: bool
    """The step is bad without any single sample to blame."""
    complete: bool = True
    """False when the run budget ran out before the search ended (nothing is claimed)."""
    every_alone: bool = False
    """Batch-level because samples spread over the batch were each bad alone (tried); not
    set when it is because the culprits would exceed half the batch."""


Probe = Callable[[Sequence[int]], bool | None]
"""Runs the step on those sample positions: True when it is non-finite, None when it raised."""


class _Budget:
    def __init__(self, bad: Probe, max_runs: int) -> None:
        self._bad = bad
        self.left = max_runs
        self.runs = 0

    def bad(self, positions: Sequence[int]) -> bool:
        return bool(self.probe(positions))

    def probe(self, positions: Sequence[int]) -> bool | None:
        """``bad``, or None when the run raised."""
        self.runs += 1
        self.left -= 1
        return self._bad(positions)


def _chunks(items: list[int], n: int) -> list[list[int]]:
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return [c for c in out if c]


def _shrink(budget: _Budget, positions: list[int]) -> list[int]:
    """A 1-minimal bad subset of ``positions`` (which is bad): delta debugging, which is
    plain halving when one sample is to blame."""
    current, n = positions, 2
    while len(current) > 1 and budget.left > 0:
        chunks = _chunks(current, n)
        found = next((c for c in chunks if budget.left > 0 and budget.bad(c)), None)
        if found is not None:
            current, n = found, 2
            continue
        if n > 2:
            for chunk in chunks:
                rest = [p for p in current if p not in chunk]
                if budget.left > 0 and budget.bad(rest):
                    found = rest
                    break
            if found is not None:
                current, n = found, max(n - 1, 2)
                continue
        if n >= len(current):
            break
        n = min(len(current), 2 * n)
    return current


def _spread(positions: list[int], count: int) -> list[int]:
    if len(positions) <= count:
        return list(positions)
    step = len(positions) / count
    return [positions[int(i * step + step / 2)] for i in range(count)]


def _one_by_exclusion(budget: _Budget, size: int) -> int | None:
    """The one sample whose removal makes the batch finite and which is bad on its own, found
    by removing halves (module docstring); None when no such sample is found that way."""
    everything = list(range(size))
    suspects = everything
    while len(suspects) > 1 and budget.left > 1:
        fixed = None
        for half in _chunks(suspects, 2):
            removed = set(half)
            if not budget.bad([p for p in everything if p not in removed]):
                fixed = half
                break
        if fixed is None:
            return None
        suspects = fixed
    if len(suspects) != 1 or budget.left <= 0:
        return None
    one = suspects[0]
    return one if _bad_by_itself(budget, one, [p for p in everything if p != one]) else None


def _bad_by_itself(budget: _Budget, one: int, others: list[int]) -> bool:
    """Whether sample ``one`` makes a batch bad without any other given sample: alone, or,
    when a run of one sample raises, with each half of ``others`` (module docstring)."""
    alone = budget.probe([one])
    if alone is not None:
        return alone
    halves = _chunks(others, 2)
    return len(halves) == 2 and all(budget.left > 0 and budget.bad([one, *h]) for h in halves)


def find_culprits(bad: Probe, size: int, max_runs: int = 64) -> Bisection:
    """Bisect ``range(size)``; ``bad(positions)`` runs the step on those samples only."""
    budget = _Budget(bad, max_runs)
    if size > 1:
        one = _one_by_exclusion(budget, size)
        if one is not None:
            return Bisection([one], budget.runs, batch_level=False)
    remaining = list(range(size))
    culprits: list[int] = []
    while remaining and budget.left > 0:
        found = _shrink(budget, remaining)
        if budget.left <= 0:
            return Bisection([], budget.runs, batch_level=False, complete=False)
        culprits.extend(found)
        remaining = [p for p in remaining if p not in found]
        if 2 * len(culprits) > size or not remaining:
            break
        if not budget.bad(remaining):
            return Bisection(sorted(culprits), budget.runs, batch_level=False)
        if len(culprits) == len(found) and _all_bad_alone(budget, _spread(remaining, 3)):
            return Bisection([], budget.runs, batch_level=True, every_alone=True)
    return Bisection([], budget.runs, batch_level=True)


def _all_bad_alone(budget: _Budget, probes: list[int]) -> bool:
    for position in probes:
        if budget.left <= 0 or not budget.bad([position]):
            return False
    return bool(probes)
