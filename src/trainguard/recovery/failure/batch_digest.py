"""A digest of a step's first batch, written with a state at a failure or a checkpoint and
checked when a resume reaches that step's boundary again.

A resume at the step in flight re-reads the iterable given to ``watch()`` and drops the
items before the step's position: the order must be the first attempt's. An iterable that
starts where the loop left off by itself (a stream seeded by the loop's step, a loader the
script resumes) then lands elsewhere, and the run would train on other batches with no
error. The survivors hold the step's first batch when they write their state (a checkpoint
holds it when it is written): its digest goes in, and a rank resuming from its own state or
checkpoint compares the batch it is given at that step (``Recovery.step_boundary``).

Only CPU tensors are read (their bytes, in the batch's order, with dtype and shape): a
failing rank must not wait on a device, and a resume reads it once. A batch with a tensor
elsewhere, or none, has no digest and is not checked.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch
from torch import Tensor

from trainguard.capture.batchtree import tensors
from trainguard.events import EventLog
from trainguard.recovery.types import Stream

logger = logging.getLogger(__name__)


def batch_digest(batch: Any) -> str | None:
    """The SHA-256 of ``batch``'s tensors (None: no tensor, one not on the CPU, or one
    whose bytes cannot be read: a sparse or quantized tensor)."""
    leaves = tensors(batch)
    if not leaves or any(t.device.type != "cpu" for t in leaves):
        return None
    digest = hashlib.sha256()
    for tensor in leaves:
        raw = _raw(tensor)
        if raw is None:
            return None
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(raw)
    return digest.hexdigest()


def _raw(tensor: Tensor) -> memoryview | None:
    """The tensor's bytes, without a copy when it is contiguous (hashed in place)."""
    try:
        flat = tensor.detach().contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy().data
    except (RuntimeError, TypeError, ValueError):
        return None


def check_resumed_batch(
    events: EventLog, rank: int, step: int, expected: str, stream: Stream
) -> None:
    """The resumed ``step``'s first batch (the one ``stream`` hands out now) against the
    digest the failed attempt wrote for it; another batch is said on this rank, in one line
    and a ``resume_data_mismatch`` event (the module docstring)."""
    got = batch_digest(stream.view.step_batch)
    if got is None or got == expected:
        return
    position = stream.view.step_position
    events.write("resume_data_mismatch", step, position=position, epoch=stream.epoch)
    logger.warning(
        "trainguard: rank %d: the batch watch() hands out at the resumed step %d (position "
        "%d of epoch %d) is not the one the failed attempt had there: the iterable does not "
        "restart where the first attempt's did (a stream seeded by the loop's step, a loader "
        "that resumes itself?); give watch() the iterable from its beginning, it skips to the "
        "position itself (docs/recovery.md)",
        rank,
        step,
        position,
        stream.epoch,
    )
