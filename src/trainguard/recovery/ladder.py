"""The escalation ladder: what each rollback without progress adds.

Skipping data alone often re-diverges (OPT, BLOOM): the first escalation rolls back and skips
the batches; the next one also backs off the LR; the next also resets the optimizer moments
with a few zero-LR steps; past ``max_rollbacks`` the guard stops with NonFiniteError.
"Without progress": the run has not yet passed the last failure's step by ``good_after``
healthy steps.
"""

from __future__ import annotations

import enum


class Rung(enum.Enum):
    ROLLBACK = "rollback"
    """Restore the newest good snapshot, skip the batches since."""
    BACKOFF = "rollback+lr_backoff"
    """The same, and the LR factor drops to ``lr_backoff``, ramped back to 1."""
    RESET_MOMENTS = "rollback+lr_backoff+reset_moments"
    """The same, and the optimizer state is cleared, with ``zero_lr_steps`` at LR 0."""
    STOP = "stop"
    """Give up: NonFiniteError on every rank."""


def rung_for(attempt: int, max_rollbacks: int) -> Rung:
    """The rung of the ``attempt``-th escalation without progress (1-based)."""
    if attempt > max_rollbacks:
        return Rung.STOP
    ladder = (Rung.ROLLBACK, Rung.BACKOFF, Rung.RESET_MOMENTS)
    return ladder[min(attempt, len(ladder)) - 1]
