"""The skip ledger: which batches (and, when the loader says, which samples) were skipped, why.

One JSON line per skipped batch in ``run_dir/recovery/skipped-rank{r}.jsonl`` (each rank its
own: under a DistributedSampler each rank reads other samples). After a restart that
resumes the run from its checkpoint (``GuardConfig.resume``), the streams drop the run's
ledger positions of their epochs, so a batch skipped after the last checkpoint is never fed
again. Nothing else reads them back: a new run in the same ``run_dir``, a run restarted
without ``resume`` or resumed from the loop's own checkpoint (whose stream positions are
the loop's) feed every batch. ``samples`` (dataset indices) lets a report list them and
a person filter them out even under another world size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import DistributedSampler, SequentialSampler


@dataclass(frozen=True)
class SkipEntry:
    epoch: int
    batch: int
    """Position of the batch in the epoch's iterable (0-based)."""
    step: int
    """The step at which the rollback that skipped it happened."""
    reason: str
    samples: list[int] | None = None
    run: str | None = None
    """The id of the run that skipped it (``run_identity``); None in a ledger written before
    runs had ids (read as the current run's)."""


class SkipLedger:
    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = Path(run_dir) / "recovery" / f"skipped-rank{rank}.jsonl"

    def append(self, entries: Iterable[SkipEntry]) -> None:
        lines = [json.dumps(asdict(entry)) + "\n" for entry in entries]
        if not lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.writelines(lines)
            fh.flush()
            os.fsync(fh.fileno())

    def entries(self) -> list[SkipEntry]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(SkipEntry(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue  # a torn last line after a crash
        return out

    def positions(self, epoch: int, run: str | None) -> frozenset[int]:
        """The batch positions of ``epoch`` that run ``run`` skipped."""
        return frozenset(
            entry.batch
            for entry in self.entries()
            if entry.epoch == epoch and entry.run in (None, run)
        )


def replayable(batch_sampler: Any) -> bool:
    """Whether iterating ``batch_sampler`` again gives the epoch's batches and changes nothing:
    its sampler is sequential or a DistributedSampler (the order follows from seed and epoch).
    A shuffling sampler draws a new order from a generator (the global one, or its own, as
    torchdata's does) when iterated: the indices would be wrong and later epochs reordered."""
    sampler = getattr(batch_sampler, "sampler", None)
    return isinstance(sampler, SequentialSampler | DistributedSampler)


def sample_indices(iterable: Any, positions: Sequence[int]) -> dict[int, list[int]]:
    """Dataset indices of the batches at ``positions`` for a DataLoader (or torchdata's
    StatefulDataLoader) whose batch sampler is ``replayable``; {} when unknown."""
    batch_sampler = getattr(iterable, "batch_sampler", None)
    if batch_sampler is None or not positions or not replayable(batch_sampler):
        return {}
    wanted = set(positions)
    last = max(wanted)
    out: dict[int, list[int]] = {}
    try:
        for index, batch in enumerate(batch_sampler):
            if index in wanted:
                out[index] = [int(i) for i in batch]
            if index >= last:
                break
    except Exception:  # a sampler that cannot be iterated twice: indices unknown
        return {}
    return out


class SkippedPositions:
    """The positions of each ``watch()`` pass (by ``Stream.ident``) already skipped: recorded
    by a rollback, or dropped by a resume from the ledger. The stream never hands a position
    out twice, so a later rollback whose span covers one (a prefetched batch's start, a
    checkpoint on disk older than an earlier rollback) must not record it again."""

    def __init__(self) -> None:
        self._by_pass: dict[int, set[int]] = {}

    def seed(self, ident: int, positions: Iterable[int]) -> None:
        """The positions a resumed pass drops from the start."""
        self._by_pass[ident] = set(positions)

    def fresh(self, ident: int, positions: Iterable[int]) -> list[int]:
        """``positions`` less those of pass ``ident`` already skipped; then they are."""
        seen = self._by_pass.setdefault(ident, set())
        new = [position for position in positions if position not in seen]
        seen.update(new)
        return new
