"""What a non-finite step leaves: its ``nonfinite`` event and log line, and the error that
stops the run (``raise``, escalation after ``max_consecutive``, an fp16 loss-scale collapse).

Functions of agreed data only, so every rank writes the same event and raises the same error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainguard.config import GuardConfig
from trainguard.errors import LossScaleCollapseError, NonFiniteError
from trainguard.events import EventLog
from trainguard.step.detect import GradStats
from trainguard.step.hyperparams import describe
from trainguard.step.types import Agreement, Decision

logger = logging.getLogger(__name__)


def log_nonfinite(
    events: EventLog,
    rank: int,
    decision: Decision,
    agreement: Agreement,
    stats: GradStats,
    step: int,
    consecutive: int,
    hyperparameters: list[dict[str, Any]] | None = None,
) -> None:
    """The ``nonfinite`` event (which ranks, loss or gradients, which parameters here; with a
    non-finite hyper-parameter, which ones here) and a warning on rank 0."""
    found = {"hyperparameters": hyperparameters} if hyperparameters else {}
    events.write(
        "nonfinite",
        step,
        where=agreement.where,
        ranks=agreement.ranks,
        loss_ranks=agreement.loss_ranks,
        grad_ranks=agreement.grad_ranks,
        params=stats.bad_names(),
        loss=agreement.mean_loss,  # agreed: NaN when any rank's is (as the loss scalar)
        losses=agreement.losses,  # every rank's
        action=decision.value,
        consecutive=consecutive,
        **found,
    )
    log = logger.warning if rank == 0 else logger.debug
    detail = INPUTS_ON_PURPOSE if agreement.where == "input" else ""
    if hyperparameters:
        detail = f" ({describe(hyperparameters)}: the update would write it into the weights)"
    log(
        "trainguard: step %d non-finite %s on ranks %s (%d in a row): %s%s",
        step,
        agreement.where,
        agreement.ranks,
        consecutive,
        decision.value,
        detail,
    )


INPUTS_ON_PURPOSE = (
    " (the batch holds NaN/Inf while the loss and gradients are finite; if it does on purpose,"
    " as an additive -inf attention mask does, name it in inputs.ignore, e.g."
    " inputs=InputConfig(ignore=('attention_mask',)) (trainguard run: --ignore-inputs NAME),"
    " or pass inputs=InputConfig(check=False) (--no-check-inputs))"
)
"""Said where the input check alone stopped a step: the fix for inputs meant to be so."""


def stop_error(
    decision: Decision,
    agreement: Agreement,
    step: int,
    bundle: Path | None,
    config: GuardConfig,
    consecutive: int,
    events: EventLog,
) -> NonFiniteError:
    """The error every rank raises for a ``RAISE`` or ``ESCALATE`` decision (escalations
    also write their ``escalate`` event)."""
    if decision is Decision.RAISE:
        message = f"step {step}: non-finite {agreement.where} on ranks {agreement.ranks}"
        return NonFiniteError(message, step=step, ranks=agreement.ranks, bundle=bundle)
    scale = agreement.loss_scale  # agreed: the smallest rank's
    other = agreement.loss_ranks or agreement.input_ranks or agreement.hyper_ranks
    if not other and scale is not None:
        message = (
            f"step {step}: fp16 loss scale collapsed to {scale} (below min_loss_scale="
            f"{config.min_loss_scale}); gradients overflow at any scale"
        )
        events.write("escalate", step, reason="loss_scale", scale=scale)
        return LossScaleCollapseError(message, step=step, ranks=agreement.ranks, bundle=bundle)
    message = (
        f"step {step}: {consecutive} non-finite steps in a row "
        f"(max_consecutive={config.max_consecutive}); last on ranks {agreement.ranks}"
        + (INPUTS_ON_PURPOSE if agreement.where == "input" else "")
    )
    events.write("escalate", step, reason="max_consecutive", consecutive=consecutive)
    return NonFiniteError(message, step=step, ranks=agreement.ranks, bundle=bundle)
