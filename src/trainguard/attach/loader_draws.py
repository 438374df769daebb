"""Dataset indices in an unmodified script: the samples of the batch a ``DataLoader`` yielded.

``watch()`` follows the sampler of the loader iterator it made itself
(``capture/sampler_indices.py``), so a bad sample is named by its dataset index. Under
``trainguard run`` the script iterates its loaders itself and the guard saw only the model's
calls: a bad input was "sample 3 of the batch", useless for finding it in the data. So the
loader iterator's class is wrapped, process-wide, as the clipping functions are
(``clip.py``): its draw (``_next_index``, where the sampler's indices are taken in the main
process, workers or not) and its yield (``__next__``). Per iterator, in a side table held
weakly (nothing is stored on the iterator, the loader or the sampler), the draws of its
current pass are kept in order; in sampler order (a map-style dataset, ``in_order``) the
``n``-th batch a pass yields is its ``n``-th draw. A new pass (a new sampler iterator:
``persistent_workers`` reuses the loader iterator) starts a new record.

A batch is told from the others by a probe of its first tensor, taken as the loader yields
it: its shape and a few of its values at fixed positions (one small CPU read: a yield's
tensors are on the host). A bad step's micro-batch, the guarded model's call arguments, is
probed the same way (on its device, at the bad step only) and named by the indices of the
newest of the last ``RECENT`` yields whose probe is the same. So a loop that fetches ahead
(Lightning's and accelerate's loaders hold the next batch before the model sees this one)
names the batch the model ran, not the one fetched last; a batch moved to the device as it
is matches; one the loop split, merged, cast or normalized matches none and stays unknown.
The draws and the yields pass through unchanged: the loader yields what it yields bare, and
the sampler and the RNG move as they do bare.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import dataloader as _dataloader

from trainguard.capture.batchtree import tensors
from trainguard.capture.sampler_indices import SamplerIndices
from trainguard.step.types import IndicesOf

logger = logging.getLogger(__name__)

RECENT = 8
"""Yields kept to match a forward's batch against (a loop holds one or two ahead)."""
PROBED = 8
"""Values a probe reads, at evenly spread positions of the flattened tensor."""

_ITERATOR = _dataloader._BaseDataLoaderIter

Probe = tuple[tuple[int, ...], list[Any]]
"""A tensor's shape and its values at ``PROBED`` fixed positions."""


class _Pass:
    """One pass of one loader iterator: its draws (``SamplerIndices``, each kept as drawn:
    a batch sampler may hand the same list back refilled) and how many batches it yielded."""

    __slots__ = ("draws", "sampler_iter", "yields")

    def __init__(self, sampler_iter: Iterator[Any]) -> None:
        self.draws = SamplerIndices(0, None)
        self.sampler_iter = weakref.ref(sampler_iter) if _weakable(sampler_iter) else None
        self.yields = 0

    def goes_on(self, sampler_iter: Iterator[Any]) -> bool:
        """Whether a draw from ``sampler_iter`` belongs to this pass (the same iterator)."""
        return self.sampler_iter is not None and self.sampler_iter() is sampler_iter


def _weakable(value: Any) -> bool:
    try:
        weakref.ref(value)
    except TypeError:
        return False
    return True


def _followed(iterator: Any) -> bool:
    """A torch loader's iterator over a map-style dataset that yields in sampler order."""
    return getattr(iterator, "_dataset_kind", None) == _dataloader._DatasetKind.Map and bool(
        getattr(iterator, "_in_order", True)
    )


def _first_tensor(batch: Any) -> Tensor | None:
    """The first tensor of a batch with a leading (sample) dimension; None when that is a
    tensor subclass (a DTensor's ops may be collectives: never on one rank alone)."""
    first = next((t for t in tensors(batch) if t.dim() and t.numel()), None)
    return first if type(first) is Tensor else None


def probe(tensor: Tensor) -> Probe:
    """``tensor``'s shape and values at ``PROBED`` evenly spread flat positions (read on the
    host: a copy of those few values only)."""
    count = tensor.numel()
    key = (count, tensor.device)
    positions = _POSITIONS.get(key)
    if positions is None:
        taken = min(PROBED, count)
        spread = [i * count // taken for i in range(taken)]
        positions = _POSITIONS[key] = torch.tensor(spread, device=tensor.device)
        if len(_POSITIONS) > 64:  # sizes that keep changing: no cache to grow
            _POSITIONS.clear()
    values = torch.take(tensor.detach(), positions).cpu().tolist()
    return tuple(tensor.shape), values


_POSITIONS: dict[tuple[int, torch.device], Tensor] = {}
"""The probe's positions per tensor size and device (made once)."""


def _same(one: Probe, other: Probe) -> bool:
    """Equal shapes and values (a NaN equals a NaN: a bad sample's own value)."""
    if one[0] != other[0] or len(one[1]) != len(other[1]):
        return False
    return all(a == b or _both_nan(a, b) for a, b in zip(one[1], other[1], strict=True))


def _both_nan(a: Any, b: Any) -> bool:
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


class LoaderDraws:
    """The wrappers of the loader iterator's class and the draws and yields they keep."""

    def __init__(self) -> None:
        self._passes: weakref.WeakKeyDictionary[Any, _Pass] = weakref.WeakKeyDictionary()
        self._recent: deque[tuple[_Pass, int, Probe]] = deque(maxlen=RECENT)
        """The last yields of followed loaders: the pass, the batch's position, its probe
        (the pass held: ``next(iter(loader))`` drops its iterator at once)."""
        self._originals: dict[str, Any] = {}

    def install(self) -> None:
        """Wrap ``_next_index`` and ``__next__`` of torch's loader iterator class (once)."""
        if self._originals:
            return
        draw, yielded = _ITERATOR._next_index, _ITERATOR.__next__
        self._originals = {"_next_index": draw, "__next__": yielded}
        follower = self

        def _next_index(iterator: Any) -> Any:
            drawn = draw(iterator)  # type: ignore[no-untyped-call]
            follower._drew(iterator, drawn)
            return drawn

        def __next__(iterator: Any) -> Any:
            batch = yielded(iterator)
            follower._yielded(iterator, batch)
            return batch

        _ITERATOR._next_index = _next_index  # type: ignore[method-assign]
        _ITERATOR.__next__ = __next__  # type: ignore[method-assign,assignment]

    def remove(self) -> None:
        """Put torch's own methods back (where still ours) and forget every draw."""
        for name, original in self._originals.items():
            if getattr(_ITERATOR, name).__qualname__.startswith(LoaderDraws.install.__qualname__):
                setattr(_ITERATOR, name, original)
        self._originals = {}
        self._passes = weakref.WeakKeyDictionary()
        self._recent.clear()

    def _drew(self, iterator: Any, drawn: Any) -> None:
        try:
            sampler_iter = iterator._sampler_iter
            found = self._passes.get(iterator)
            if found is None or not found.goes_on(sampler_iter):
                if not _followed(iterator):
                    return
                found = self._passes[iterator] = _Pass(sampler_iter)
            found.draws.drew(drawn)
        except Exception:  # never the script's failure: its indices stay unknown
            logger.debug("trainguard run: a loader's draw not followed", exc_info=True)

    def _yielded(self, iterator: Any, batch: Any) -> None:
        found = self._passes.get(iterator)
        if found is None:
            return
        position, found.yields = found.yields, found.yields + 1
        try:
            first = _first_tensor(batch)
            if first is not None:
                self._recent.append((found, position, probe(first)))
        except Exception:  # never the script's failure: this batch stays unknown
            logger.debug("trainguard run: a loader's batch not probed", exc_info=True)

    def at_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> IndicesOf | None:
        """At a training forward called with ``args``/``kwargs``: what gives its dataset
        indices when a bad step asks (those of the newest recent yield whose probe is its
        first tensor's), None when no followed loader yielded lately."""
        if not self._recent:
            return None
        try:
            first = _first_tensor((args, kwargs))
            candidates = list(self._recent)
        except Exception:  # never the script's failure
            return None
        if first is None:
            return None

        def indices() -> list[int] | None:
            try:
                called = probe(first)
            except Exception:  # a tensor torch.take refuses (sparse, another layout)
                return None
            for found, position, yielded in reversed(candidates):
                if _same(called, yielded):
                    drawn = found.draws.indices(position)
                    return drawn if drawn is not None and len(drawn) == called[0][0] else None
            return None

        return indices
