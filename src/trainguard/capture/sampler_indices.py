"""The dataset indices of the batches a ``DataLoader`` hands ``watch()``, as its sampler drew them.

A bad sample is named by its dataset index only when the batch carries one (an ``index`` field,
``batchtree.dataset_indices``). Most loops' batches do not: ``DataLoader(dataset,
sampler=DistributedSampler(dataset))`` yields tensors, and the diagnosis could only say "sample
3 of micro-batch 0", useless for finding the sample in the data. Yet the loader's sampler drew
exactly those indices. So when ``watch()`` iterates a torch ``DataLoader`` over a map-style
dataset, ``follow`` wraps the sampler iterator of the loader iterator that ``watch()`` itself
made (never the user's loader or sampler) with one that keeps each draw, in order; batch
``n`` of the pass is draw ``n`` (the loader yields batches in the sampler's order unless
``in_order=False``, which is then not followed). The draws pass through unchanged.

A loader with workers draws its first ``prefetch_factor * num_workers`` batches while
``iter(loader)`` runs, before the wrap: those are drawn again on demand from a sampler whose
iteration changes nothing (``SequentialSampler``, ``DistributedSampler``, or a
``BatchSampler`` over one: they seed their own generator from the epoch), and otherwise stay
unknown (a ``RandomSampler`` draws its seed from the global RNG: drawing again would change
the run). The last ``WINDOW`` draws are kept (the batches a step can still be decided on);
with a batch size of ``None`` each draw is one index.

Iterators of other loaders (torchdata's ``StatefulDataLoader`` saves its sampler iterator's
state) are not followed.
"""

from __future__ import annotations

import weakref
from array import array
from collections import deque
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler
from torch.utils.data import dataloader as _dataloader

WINDOW = 256
"""Draws kept: far more than a loop holds ahead (``step/batches.MAX_AHEAD``)."""

_FOLLOWED = (_dataloader._SingleProcessDataLoaderIter, _dataloader._MultiProcessingDataLoaderIter)
_PURE = (SequentialSampler, DistributedSampler)
"""Samplers whose iteration changes no state: drawn again, they draw the same indices."""


def _as_indices(drawn: Any) -> array[int] | None:
    """A draw as an array of indices (one index, or a batch's list), None for other keys."""
    if isinstance(drawn, int) and not isinstance(drawn, bool):
        return array("q", [drawn])
    if isinstance(drawn, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in drawn
    ):
        return array("q", drawn)
    return None


def _pure(sampler: Any) -> bool:
    if type(sampler) is BatchSampler:
        return type(sampler.sampler) in _PURE
    return type(sampler) in _PURE


def _epoch(sampler: Any) -> int | None:
    inner = sampler.sampler if type(sampler) is BatchSampler else sampler
    epoch = getattr(inner, "epoch", None)
    return epoch if isinstance(epoch, int) else None


class _Draws:
    """The sampler iterator the loader iterator reads from: each draw kept, then passed on.
    It holds its record weakly: the loader may keep its iterator (``persistent_workers``)."""

    def __init__(self, inner: Iterator[Any], record: SamplerIndices) -> None:
        self._inner = inner
        self._record = weakref.ref(record)

    def __iter__(self) -> _Draws:
        return self

    def __next__(self) -> Any:
        drawn = next(self._inner)
        record = self._record()
        if record is not None:
            record.drew(drawn)
        return drawn


class SamplerIndices:
    """``indices(position)``: the dataset indices of item ``position`` of one pass."""

    def __init__(self, before: int, sampler: Any, base: int = 0) -> None:
        self._draws: deque[array[int] | None] = deque(maxlen=WINDOW)
        self._count = before
        """Draws so far (the first ``before`` made before the wrap)."""
        self._before = before
        self._base = base
        """The position (``watch()``'s count of items) of the pass's first item."""
        self._sampler = sampler if before and _pure(sampler) else None
        self._epoch = _epoch(sampler)
        """A ``DistributedSampler``'s epoch when the pass began: drawn again in another, the
        early draws would be another epoch's."""
        self._early: list[array[int] | None] | None = None

    @classmethod
    def follow(cls, iterator: Any, base: int = 0) -> SamplerIndices | None:
        """Follow the draws of ``iterator``, made by ``iter(loader)`` for ``watch()``, whose
        first item is ``watch()``'s position ``base``; None when it is not a torch
        ``DataLoader``'s over a map-style dataset in sampler order."""
        if type(iterator) not in _FOLLOWED or not getattr(iterator, "_in_order", True):
            return None
        inner = getattr(iterator, "_sampler_iter", None)
        kind = getattr(iterator, "_dataset_kind", None)
        if inner is None or kind != _dataloader._DatasetKind.Map:
            return None
        before = int(getattr(iterator, "_send_idx", 0))  # drawn at iter(): workers' prefetch
        record = cls(before, getattr(iterator, "_index_sampler", None), base)
        iterator._sampler_iter = _Draws(inner, record)
        return record

    def drew(self, drawn: Any) -> None:
        self._draws.append(_as_indices(drawn))
        self._count += 1

    def indices(self, position: int) -> list[int] | None:
        """The dataset indices of the pass's item ``position`` (None: not known)."""
        position -= self._base
        if position < 0:
            return None
        if position < self._before:
            return self._drawn_again(position)
        back = self._count - position
        if back <= 0 or back > len(self._draws):
            return None
        found = self._draws[-back]
        return None if found is None else found.tolist()

    def of_positions(self, positions: list[int]) -> list[list[int] | None]:
        """``indices`` of each position (a step's micro-batches)."""
        return [self.indices(position) for position in positions]

    def _drawn_again(self, position: int) -> list[int] | None:
        """One of the draws made before the wrap, from a sampler whose iteration is pure."""
        if self._sampler is None or _epoch(self._sampler) != self._epoch:
            return None
        if self._early is None:
            early: list[array[int] | None] = []
            for drawn in iter(self._sampler):
                early.append(_as_indices(drawn))
                if len(early) == self._before:
                    break
            self._early = early
        found = self._early[position] if position < len(self._early) else None
        return None if found is None else found.tolist()
