"""The decision for a step, from agreed data only, so every rank decides the same."""

from __future__ import annotations

import enum

from trainguard.config import GuardConfig
from trainguard.step.consensus import Agreement


class Decision(enum.Enum):
    """What the guard does with a checked step."""

    OK = "ok"
    """Finite everywhere: the optimizer may step."""
    SKIP = "skip"
    """Non-finite: gradients cleared, ``check()`` returns False."""
    WARN = "warn"
    """Non-finite: logged, gradients left alone, ``check()`` returns False."""
    RAISE = "raise"
    """Non-finite and the policy is "raise": NonFiniteError on every rank."""
    ESCALATE = "escalate"
    """Too many bad steps in a row (or a collapsed loss scale): stop every rank."""
    OVERFLOW = "overflow"
    """fp16 gradient overflow that the GradScaler handles: skip, scale goes down."""
    SPIKE = "spike"
    """Finite, but a loss or gradient-norm spike and ``on_spike="skip"``: skipped like "skip"."""
    DROPPED = "dropped"
    """Finite, but the loop left the update out itself on some rank (``trainguard run``: its
    own ``if``): every rank leaves it out, so the replicas stay identical. Not a bad step."""


_ACTION = {"skip": Decision.SKIP, "warn": Decision.WARN, "raise": Decision.RAISE}


def decide(agreement: Agreement, config: GuardConfig, consecutive_before: int) -> Decision:
    """Decide a step from the agreed record, the options and the guard's replicated count of
    bad steps in a row (the GradScaler's scale too comes agreed: ``Agreement.loss_scale``)."""
    scaler_scale = agreement.loss_scale
    if not agreement.bad:
        return Decision.DROPPED if agreement.drops and agreement.dropped_ranks else Decision.OK
    if agreement.scaler_dropped and not (agreement.input_ranks or agreement.hyper_ranks):
        return Decision.OVERFLOW  # every rank's scaler left out a step whose gradients overflowed
    other = agreement.loss_ranks or agreement.input_ranks or agreement.hyper_ranks
    if scaler_scale is not None and not other:
        # Gradients overflowed while the loss is finite: the scaler's business, unless the
        # scale has collapsed (then no scale makes the gradients fit).
        if scaler_scale < config.min_loss_scale:
            return Decision.ESCALATE
        return Decision.OVERFLOW
    if consecutive_before + 1 >= config.max_consecutive and config.on_nonfinite != "raise":
        return Decision.ESCALATE
    return _ACTION[config.on_nonfinite]
