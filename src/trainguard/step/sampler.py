"""DistributedSampler pitfalls: a new epoch whose sampler epoch did not change.

``DistributedSampler`` shuffles with ``seed + epoch``; without ``sampler.set_epoch(e)`` every
epoch sees the same order. The guard notes the sampler's epoch at each ``watch()``; a second
``watch()`` of the same loader at the same sampler epoch writes a ``sampler_epoch`` warning.
"""

from __future__ import annotations

import logging
from typing import Any

from trainguard.events import EventLog

logger = logging.getLogger(__name__)


def distributed_sampler(iterable: Any) -> Any:
    """The DistributedSampler behind a DataLoader (or the iterable itself), or None."""
    from torch.utils.data.distributed import DistributedSampler

    for candidate in (
        iterable,
        getattr(iterable, "sampler", None),
        getattr(getattr(iterable, "batch_sampler", None), "sampler", None),
    ):
        if isinstance(candidate, DistributedSampler):
            return candidate
    return None


class SamplerEpochs:
    """Remembers each watched sampler's epoch; warns when an epoch starts at the same one."""

    def __init__(self, events: EventLog, rank: int) -> None:
        self._events = events
        self._rank = rank
        self._seen: dict[int, int] = {}

    def starting(self, iterable: Any, step: int) -> bool:
        """Note an epoch start; True (and a warning event) when ``set_epoch`` was forgotten."""
        sampler = distributed_sampler(iterable)
        if sampler is None:
            return False
        epoch = int(getattr(sampler, "epoch", 0))
        previous = self._seen.get(id(sampler))
        self._seen[id(sampler)] = epoch
        if previous is None or previous != epoch:
            return False
        self._events.write("sampler_epoch", step, epoch=epoch)
        if self._rank == 0:
            logger.warning(
                "trainguard: a new epoch started with DistributedSampler epoch %d again: call "
                "sampler.set_epoch(epoch) before each epoch, or every epoch sees the same order",
                epoch,
            )
        return True
