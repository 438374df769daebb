"""The batches a rollback undoes, across epochs.

A rollback restores the weights of a snapshot (or checkpoint) and goes on reading the stream
where it is: every batch from the snapshot's position up to the first one the loop has not
trained on was consumed and is not fed again. When the snapshot was taken in an earlier
``watch()`` pass (an epoch that has ended since), that is the rest of the snapshot's epoch
from its position, every whole epoch between, and the current epoch from its start.

``EndedStreams`` remembers, per ``watch()`` pass that has ended (the last ``KEPT``), its
epoch and how far it read. ``ended_entries`` gives the skip-ledger entries of the ended
passes a rollback undoes, oldest first; ``skipped_positions`` the current pass's span (and
``skip_margin`` more, dropped from the stream); ``rollback_entries`` both, each batch once
(``ledger.SkippedPositions``). Their dataset indices are read again as the current pass's
are (``ledger.sample_indices``), a ``DistributedSampler`` set back to the pass's epoch for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trainguard.recovery import snapshot as snap
from trainguard.recovery.ledger import SkipEntry, SkippedPositions, sample_indices
from trainguard.recovery.types import Stream

KEPT = 64
"""Ended passes remembered (a rollback reaches back into at most so many epochs)."""


@dataclass(frozen=True)
class EndedStream:
    """A ``watch()`` pass that has ended (the loop called ``watch()`` again)."""

    ident: int
    """Which ``watch()`` call it was (``Stream.ident``)."""
    epoch: int
    end: int
    """Position in the iterable after the last batch taken from it."""
    iterable: Any
    sampler_epoch: int | None
    """The epoch its ``DistributedSampler`` had while the pass ran (None: none), so that its
    batches' dataset indices can be read again after ``set_epoch`` moved on."""


def sampler_epoch(iterable: Any) -> int | None:
    """The epoch of the ``DistributedSampler`` behind ``iterable`` now (None: none)."""
    sampler = getattr(getattr(iterable, "batch_sampler", None), "sampler", None)
    epoch = getattr(sampler, "epoch", None)
    return epoch if isinstance(epoch, int) else None


class EndedStreams:
    """The ended ``watch()`` passes, oldest first."""

    def __init__(self) -> None:
        self._ended: list[EndedStream] = []

    def add(self, ended: EndedStream) -> None:
        self._ended.append(ended)
        del self._ended[:-KEPT]

    def ident_of_epoch(self, epoch: int) -> int:
        """The newest ended pass of ``epoch`` (a checkpoint names its epoch, not its pass);
        -1 when none ended here."""
        return next((e.ident for e in reversed(self._ended) if e.epoch == epoch), -1)

    def undone_spans(self, ident: int, position: int) -> Iterator[tuple[EndedStream, range]]:
        """The ended passes a rollback to position ``position`` of pass ``ident`` undoes: that
        pass from ``position``, every later ended pass whole. None when ``ident`` is -1 (not
        a pass of this process) or the current one."""
        if ident < 0:
            return
        for ended in self._ended:
            if ended.ident == ident:
                yield ended, range(position, ended.end)
            elif ended.ident > ident:
                yield ended, range(0, ended.end)


def ended_samples(ended: EndedStream, positions: list[int]) -> dict[int, list[int]]:
    """Dataset indices of ``positions`` of an ended pass: read again with its
    ``DistributedSampler`` set back to the pass's epoch for the read (``ledger.replayable``
    says which samplers can be read again at all); {} when unknown."""
    sampler = getattr(getattr(ended.iterable, "batch_sampler", None), "sampler", None)
    now = getattr(sampler, "epoch", None)
    if ended.sampler_epoch is None or not isinstance(now, int):
        return sample_indices(ended.iterable, positions)
    sampler.epoch = ended.sampler_epoch  # type: ignore[union-attr]
    try:
        return sample_indices(ended.iterable, positions)
    finally:
        sampler.epoch = now  # type: ignore[union-attr]


def ended_entries(
    ended: EndedStreams,
    target: snap.Snapshot,
    step: int,
    run: str | None,
    skipped: SkippedPositions,
) -> list[SkipEntry]:
    """The skip-ledger entries of the ended passes a rollback at ``step`` to ``target``
    undoes (``EndedStreams.undone_spans``), less the positions already ``skipped``; a
    checkpoint's pass is found by its epoch."""
    ident = target.stream_id
    if ident == -1 and "data_epoch" in target.extra:  # a checkpoint of an earlier epoch
        ident = ended.ident_of_epoch(target.extra["data_epoch"])
    entries: list[SkipEntry] = []
    for stream, span in ended.undone_spans(ident, target.position):
        positions = skipped.fresh(stream.ident, span)
        samples = ended_samples(stream, positions)
        entries += [
            SkipEntry(stream.epoch, pos, step, "rollback", samples.get(pos), run)
            for pos in positions
        ]
    return entries


def earlier_batches(skipped: list[SkipEntry], epoch: int | None) -> list[dict[str, Any]]:
    """The skipped batches of epochs other than ``epoch``, per epoch (the rollback event's
    ``earlier_batches_skipped``): ``[{"epoch", "batches"}]``."""
    per_epoch: dict[int, list[int]] = {}
    for entry in skipped:
        if entry.epoch != epoch:
            per_epoch.setdefault(entry.epoch, []).append(entry.batch)
    return [{"epoch": e, "batches": batches} for e, batches in per_epoch.items()]


def skipped_positions(stream: Stream, start: int, margin: int) -> list[int]:
    """The batch positions of ``stream`` a rollback to ``start`` skips, the ones not handed
    out yet dropped from the stream: every position from ``start`` up to the loop's next batch
    (one it fetched ahead trains the restored step), then ``margin`` more of the same pass,
    fetched already or dropped as they come, up to the pass's end when the iterable has a
    length (``skip_margin``)."""
    view = stream.view
    positions = list(range(start, view.untrained_position))
    first = view.position
    view.drop_next(margin)  # with 0: the counts changed, agree afresh
    end = first + margin
    with contextlib.suppress(TypeError, NotImplementedError):  # no length: not capped
        end = min(end, len(stream.iterable))
    return positions + list(range(first, end))


def rollback_entries(
    stream: Stream,
    ended: EndedStreams,
    skipped: SkippedPositions,
    target: snap.Snapshot,
    step: int,
    run: str | None,
    margin: int,
) -> list[SkipEntry]:
    """The skip-ledger entries of a rollback at ``step`` to ``target``: the ended passes it
    undoes, then the current pass from the target's position (``skipped_positions``), each
    batch once (``SkippedPositions``)."""
    entries = ended_entries(ended, target, step, run, skipped)
    start = target.position if target.stream_id == stream.ident else 0
    positions = skipped.fresh(stream.ident, skipped_positions(stream, start, margin))
    samples = sample_indices(stream.iterable, positions)
    return entries + [
        SkipEntry(stream.epoch, pos, step, "rollback", samples.get(pos), run) for pos in positions
    ]
