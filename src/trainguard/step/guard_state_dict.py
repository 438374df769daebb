"""``Guard.state_dict()`` / ``load_state_dict()``: the guard's part of the loop's own checkpoint.

What the guard needs to go on as if it had not stopped: its counters and step (``GuardState``,
which carries the spike statistics), and with recovery on the recovery state (the LR backoff
in force and how far it has ramped, rollbacks so far and since the last progress). Plain
Python values only (ints, floats, lists, dicts, None), so ``torch.save`` /
``torch.load(weights_only=True)``, JSON or any checkpoint format takes it as it is.

Not in it: the in-memory snapshots (taken again from the loaded weights), the batches and RNG
(the loop's own checkpoint holds its data position), the history ring and the health windows
(they refill within a few steps).
"""

from __future__ import annotations

from typing import Any

from trainguard.errors import ConfigError, NonFiniteError
from trainguard.recovery.types import RecoveryState
from trainguard.step.state import GuardState

FORMAT = 1

_FIX = "pass the dict guard.state_dict() returned (as saved in your checkpoint)"


def guard_state_dict(
    counters: dict[str, Any], recovery: RecoveryState | None, stopped_at: int | None = None
) -> dict[str, Any]:
    """``counters``: ``GuardState.state_dict()`` (the sync-free step's settled ones);
    ``stopped_at``: a step not read yet whose reading stops the run (``stopped_at`` in the
    dict: loading it raises, as the run it was saved from was to stop there)."""
    saved: dict[str, Any] = {"format": FORMAT, "state": counters}
    if recovery is not None:
        saved["recovery"] = recovery.state_dict()
    if stopped_at is not None:
        saved["stopped_at"] = stopped_at
    return saved


def load_guard_state(saved: Any, state: GuardState, recovery: RecoveryState | None) -> None:
    """Restore what ``guard_state_dict`` saved. A dict saved without recovery leaves the
    recovery state as it is (no backoff); one saved with it, loaded by a guard without
    recovery, drops it. ``{"step": N}`` alone: the loop resumes a checkpoint saved before the
    guard was added, at its own step ``N`` (every counter else as at a start)."""
    if isinstance(saved, dict) and set(saved) == {"step"}:
        step = saved["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError("state_dict", f"got step {step!r}; use the loop's step, an int >= 0")
        saved = {"format": FORMAT, "state": {**GuardState().state_dict(), "step": step}}
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        raise ConfigError(
            "state_dict",
            f"got {type(saved).__name__} without a 'state'; {_FIX}, or {{'step': N}} for a "
            "checkpoint saved before the guard was added",
        )
    version = saved.get("format", FORMAT)
    if version != FORMAT:
        raise ConfigError(
            "state_dict", f"format {version!r} is not {FORMAT} (saved by another trainguard)"
        )
    state.load_state_dict(saved["state"])
    if recovery is not None and isinstance(saved.get("recovery"), dict):
        recovery.load_state_dict(saved["recovery"])
    stopped = saved.get("stopped_at")
    if isinstance(stopped, int):
        raise NonFiniteError(
            f"step {stopped}: the run this state was saved from stops there (its sync-free "
            "step() read the step as non-finite past the policy's limit after the save); "
            "resume from a checkpoint before it, or fix the cause (its bundle, if captured, "
            "is in the run dir's captures/)",
            step=stopped,
            ranks=[],
        )
