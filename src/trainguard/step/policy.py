"""The decision for a step, from agreed data only, so every rank decides the same."""

from __future__ import annotations

from trainguard.config import GuardConfig
from trainguard.step.types import Agreement, Decision

_ACTION = {"skip": Decision.SKIP, "warn": Decision.WARN, "raise": Decision.RAISE}


def decide(agreement: Agreement, config: GuardConfig, consecutive_before: int) -> Decision:
    """Decide a step from the agreed record, the options and the guard's replicated count of
    bad steps in a row (the GradScaler's scale too comes agreed: ``Agreement.loss_scale``)."""
    if not agreement.bad:
        return Decision.DROPPED if agreement.drops and agreement.dropped_ranks else Decision.OK
    scaler_scale = agreement.loss_scale
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
