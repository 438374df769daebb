"""The guard's explicitly internal interface for trainguard's own wrappers.

``trainguard run`` (``attach/``) and the framework integrations (``integrations/``) drive a
``Guard`` from hooks the loop does not know about: a step the script left out itself, the
gradients a skip held back and gives back after the script's optimizer step, the start of a
step recorded before the guard existed, a successor guard taking over a run. They do it
through ``Guard.internals``, this one documented surface, never through the guard's private
attributes; it is not part of the public API (it may change with the wrappers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from trainguard.config import GuardConfig
from trainguard.hang.watchdog import Watchdog
from trainguard.step.buffers import BufferKeeper
from trainguard.step.evidence import StepEvidence
from trainguard.step.recorded_batches import RecordedBatches
from trainguard.step.state import GuardState
from trainguard.step.step_start import StepStart
from trainguard.step.types import ForwardDraws, IndicesOf
from trainguard.step.update_drop import UpdateDrop


class Parts(Protocol):
    """The guard's parts these reach (``step/assembly.py``'s ``GuardParts``)."""

    @property
    def step_start(self) -> StepStart: ...

    @property
    def recorded(self) -> RecordedBatches: ...

    @property
    def drop_update(self) -> UpdateDrop: ...

    @property
    def evidence(self) -> StepEvidence: ...

    @property
    def watchdog(self) -> Watchdog | None: ...


class Guard(Protocol):
    """The guard these drive (``step/guard.py``'s ``Guard``; a protocol, so this module does
    not import the guard that hands it out)."""

    config: GuardConfig
    state: GuardState

    @property
    def _parts(self) -> Parts: ...

    def _check_dropped(self, scaled: bool) -> bool: ...
    def _check_leaving(self, loss: Tensor | None) -> bool: ...

    def _load_state(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class StartRecord:
    """The start of a step as a forward hook records it: RNG states, autocast state, the
    buffers as they were, the step's micro-batches."""

    rng: dict[str, Any]
    autocast: dict[str, Any]
    buffers: BufferKeeper
    recorded: RecordedBatches
    draws: list[IndicesOf | None] = field(default_factory=list)
    """Per recorded forward: what names its samples' dataset indices (``trainguard run``'s
    ``attach/loader_draws.py``; empty when not followed)."""


class GuardInternals:
    """``guard.internals``: what trainguard's own wrappers may do to a guard."""

    def __init__(self, guard: Guard) -> None:
        self._guard = guard

    def recorded_batches(self) -> RecordedBatches:
        """The step's micro-batches as ``record_batch`` kept them (``trainguard run`` adds the
        loss's own inputs to them: ``attach/loss_inputs.py``)."""
        return self._guard._parts.recorded

    def started_step(self) -> int | None:
        """The step whose first forward the guard's hook saw last (None: none yet)."""
        return self._guard._parts.step_start.step

    def check_dropped(self, scaled: bool) -> bool:
        """Check a step this rank's loop left out itself (``Guard._check_dropped``)."""
        return self._guard._check_dropped(scaled)

    def check_leaving(self, loss: Tensor | None) -> bool:
        """Check this rank's last guarded step, saying that it stops guarding after it
        (``Guard._check_leaving``): every rank stops at that step
        (``GuardState.leaving_ranks``)."""
        return self._guard._check_leaving(loss)

    def keep_dropped_gradients(self) -> None:
        """A skip holds the cleared gradients back until ``give_back_gradients`` (the script's
        own optimizer step comes after the check)."""
        self._guard._parts.drop_update.keep_dropped = True

    def give_back_gradients(self) -> None:
        """A skipped step's gradients, held back, are the script's again."""
        self._guard._parts.drop_update.give_back()

    def clear_carried_gradients(self) -> int:
        """At a training forward: the skipped step's given-back gradients the loop left on
        unchanged are cleared (``UpdateDrop.carried``); returns how many."""
        drop = self._guard._parts.drop_update
        return drop.carried() if drop.given else 0

    def say_carried(self) -> None:
        """The step being checked began with gradients ``clear_carried_gradients`` cleared,
        and the loop did not clear them itself since: said once (``UpdateDrop.say_carried``)."""
        self._guard._parts.drop_update.say_carried(self._guard.state.step)

    def take_held_gradients(self, other: Guard) -> None:
        """The gradients ``other`` (a guard this one succeeds) holds back from a skip."""
        self._guard._parts.drop_update.dropped = other._parts.drop_update.dropped

    def load_state_quietly(self, state: dict[str, Any]) -> None:
        """``load_state_dict`` without its ``state_loaded`` event: a guard taking over a run
        whose steps go on rather than begin."""
        self._guard._load_state(state)

    def start_record(self) -> StartRecord | None:
        """The start of the step in progress, as the guard's forward hook recorded it (None
        when it saw none)."""
        guard = self._guard
        start = guard._parts.step_start
        if start.step != guard.state.step or start.autocast is None:
            return None
        rng = start.rng  # the snapshot's states (built now, once)
        if rng is None:
            return None
        draws = start.draws_of(guard.state.step)
        return StartRecord(rng, start.autocast, start.buffers, guard._parts.recorded, draws)

    def adopt_start(self, start: StartRecord, step: int) -> None:
        """Take ``start`` as the start of ``step`` (recorded before this guard existed), as if
        its own hook had seen that forward: buffers, RNG, autocast, micro-batches."""
        guard = self._guard
        record = guard._parts.step_start
        if guard.config.restore_buffers:
            record.buffers = start.buffers
        record.step, record.rng, record.autocast, record.seen = (
            step,
            start.rng,
            start.autocast,
            True,
        )
        record.adopt_draws(start.draws)
        guard._parts.recorded.adopt(start.recorded, step)

    def follow_loader_draws(self, draws: ForwardDraws) -> None:
        """At each training forward, ``draws`` gives what names its samples' dataset indices
        (``trainguard run``: ``attach/loader_draws.py``; the capture and the ``bad_input``
        event name them as ``watch()``'s followed sampler does)."""
        self._guard._parts.step_start.loader_draws = draws

    @property
    def watchdog_on(self) -> bool:
        """Whether the hang watchdog runs."""
        return self._guard._parts.watchdog is not None

    def name_loss_source(self, source: str | None) -> None:
        """What computed the loss the loop checks, when not the model's own forward (the HF
        Trainer's ``compute_loss``): each bundle says so."""
        self._guard._parts.evidence.loss_source = source
