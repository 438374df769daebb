"""The small types recovery passes around: the stream's view, the data position, the state
saved with every snapshot and checkpoint, and how ``watch()`` starts an epoch's stream."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainguard.recovery.backoff import Backoff
from trainguard.recovery.loader import LoaderStates


class Stateful(Protocol):
    step: int

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StreamView(Protocol):
    """What recovery needs of the guard's batch stream."""

    @property
    def position(self) -> int: ...
    @property
    def step_position(self) -> int: ...
    @property
    def untrained_position(self) -> int: ...
    @property
    def step_batch(self) -> Any: ...
    def drop_next(self, count: int) -> None: ...


@dataclass
class StreamStart:
    """How ``watch()`` starts an epoch's stream: what to skip, and the step-boundary hook."""

    iterable: Any
    epoch: int
    start_position: int
    skip_positions: frozenset[int]
    on_step_start: Callable[[], None]
    first_position: int = 0
    """Position of the iterable's first item: a loader restored from its own state."""
    loader: LoaderStates | None = None
    """Records a stateful loader's state before each fetch (when checkpoints are on)."""
    on_handout: Callable[[], None] | None = None
    """Runs at the hand-out of each step's first batch (states at a failure)."""

    def stream_args(self) -> dict[str, Any]:
        return {
            "start_position": self.start_position,
            "skip_positions": self.skip_positions,
            "on_step_start": self.on_step_start,
            "on_handout": self.on_handout,
            "first_position": self.first_position,
            "on_fetch": self.loader.before_fetch if self.loader is not None else None,
        }


def epoch_of(iterable: Any, given: int | None, watched: int) -> int:
    """The epoch of a ``watch()`` pass: given, else the DistributedSampler's, else a count."""
    if given is not None:
        return int(given)
    sampler_epoch = getattr(getattr(iterable, "sampler", None), "epoch", None)
    if isinstance(sampler_epoch, int):
        return sampler_epoch
    return watched


@dataclass
class Stream:
    view: StreamView
    iterable: Any
    epoch: int
    ident: int
    loader: LoaderStates | None = None
    sampler_epoch: int | None = None
    """Its ``DistributedSampler``'s epoch when the pass started (``undone.sampler_epoch``)."""


@dataclass(frozen=True)
class DataPoint:
    epoch: int
    position: int
    """Batches of the epoch's iterable consumed (handed out or skipped)."""
    loader_state: Any = field(default=None, compare=False)
    """The loader's own ``state_dict()`` at ``position`` (a StatefulDataLoader), if saved."""


@dataclass
class RecoveryState:
    """Saved with every snapshot and checkpoint."""

    attempts: int = 0
    """Rollbacks since the run last made progress."""
    failed_at: int | None = None
    backoff: Backoff = field(default_factory=Backoff)
    rollbacks: int = 0
    applied: int | None = 0
    """Optimizer steps the weights hold (good steps of the surviving history): a snapshot or
    checkpoint keeps its count, a rollback restores it. None: unknown (a checkpoint saved
    before it was counted)."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "failed_at": self.failed_at,
            "backoff": self.backoff.state_dict(),
            "rollbacks": self.rollbacks,
            "applied": self.applied,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.attempts = int(state["attempts"])
        self.failed_at = state["failed_at"]
        self.backoff = Backoff.from_state(state["backoff"])
        self.rollbacks = int(state.get("rollbacks", 0))
        self.applied = state.get("applied")
