"""An iterable that hands out the same buffers refilled, under ``watch()``'s lookahead.

``watch()`` fetches ahead of the loop (the next step's batches before this step's check, for
the agreement on uneven data). Most loaders make fresh tensors for every batch, so that
changes nothing. Some refill the same tensors instead: NVIDIA DALI's iterator, ring buffers
of pinned staging memory, a generator that ``copy_``\\ s into one preallocated batch. There
the fetch ahead would overwrite the batch the loop is about to train on (the loop would
train on the next batch's data, and a capture would hold it).

``RefillProbe`` looks at the first batches a ``watch()`` pass fetches: each is handed out as
a copy taken when it was fetched, and its tensors are compared with those of the batches
still held (the window the lookahead keeps). A tensor at the address of a held one (alive,
so its memory cannot have been handed to a new tensor) that is not that same tensor
unchanged (an iterable that repeats one batch) means the iterable refills its buffers: from
then on every batch is copied as fetched, and an event and a warning say so once. When none
is found within the probe, probing stops and batches are handed out as they are, at no cost.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from trainguard.capture.batchtree import map_tensors, tensors

logger = logging.getLogger(__name__)

Held = list[tuple[Tensor, int]]
"""A fetched batch's tensors (alive: referenced here) and their versions when fetched."""


class RefillProbe:
    """``take(item)``: the item to hand out (a copy while probing or once refills were
    found); ``done`` once probing ended without finding any (then the stream drops it)."""

    def __init__(self, window: int, on_found: Callable[[], None]) -> None:
        self._held: deque[Held] = deque(maxlen=window)
        self._left = 2 * window + 2
        """Batches still to probe."""
        self._on_found = on_found
        self.copying = False
        """True once refills were found: every batch is copied as fetched."""

    @property
    def done(self) -> bool:
        return not self.copying and self._left <= 0

    def take(self, item: Any) -> Any:
        if self.copying:
            return map_tensors(item, copy_of)
        self._left -= 1
        fetched = held_tensors(item)
        if refills(fetched, self._held):
            self.copying = True
            self._held.clear()
            self._on_found()
        else:
            self._held.append(fetched)
        return map_tensors(item, copy_of)  # the data as fetched, whatever comes next


def held_tensors(batch: Any) -> Held:
    """``batch``'s dense tensors and their versions now (``Tensor._version``: moved by every
    in-place write), for ``refills``; the caller keeps the batch (so them) alive."""
    return [(t, t._version) for t in tensors(batch) if t.numel() and address(t) is not None]


def refills(fetched: Held, earlier: Iterable[Held]) -> bool:
    """Whether a tensor of ``fetched`` is at the address of an ``earlier`` one (alive, so its
    memory was not handed to a new tensor) other than that same tensor unchanged (one batch
    handed over again): the earlier one's data was written over."""
    for tensor, version in fetched:
        where = address(tensor)
        for batch in earlier:
            for old, old_version in batch:
                same = old is tensor and old_version == version
                if not same and address(old) == where:
                    return True
    return False


def copy_of(tensor: Tensor) -> Tensor:
    """A copy of a batch tensor, in pinned memory when it was (a ``pin_memory=True`` loader's
    batch keeps its non-blocking copy to the GPU)."""
    if tensor.device.type == "cpu" and tensor.is_pinned():
        out = torch.empty_like(tensor, pin_memory=True)
        return out.copy_(tensor)
    return tensor.clone()


def address(tensor: Tensor) -> int | None:
    """Where a dense tensor's data starts; None for one without plain storage (sparse,
    nested, meta), which is not compared."""
    if tensor.layout is not torch.strided:
        return None
    try:
        return tensor.data_ptr()
    except RuntimeError:  # no storage (a meta or functional tensor)
        return None


def refill_reporter(events: Any, rank: int, step_of: Callable[[], int]) -> Callable[[], None]:
    """The ``on_found`` of ``RefillProbe``: a ``refilled_batches`` event and a warning, once."""

    def report() -> None:
        events.write("refilled_batches", step_of())
        logger.warning(
            "trainguard: rank %d: the iterable given to watch() hands out the same tensors "
            "refilled (a DALI-style or staging-buffer loader): each batch is copied as it is "
            "fetched from now on, so the guard's fetch ahead does not overwrite the batch the "
            "loop trains on",
            rank,
        )

    return report
