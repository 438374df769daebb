"""A learning-rate scheduler the guard was not given, after a rollback.

``torch.optim.lr_scheduler`` schedulers wrap ``optimizer.step`` (to count its calls), so one
made for the guarded optimizer is found without being given. The guard cannot save or
restore it: after a rollback it runs ahead of the weights by the optimizer steps they no
longer hold. ``Recovery`` counts the optimizer steps taken in the process and those the
weights hold (``RecoveryState.applied``, restored with a rollback's target); the warning
says the difference, which adds up over rollbacks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def unknown_scheduler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a ``torch.optim.lr_scheduler`` scheduler was made for ``optimizer`` (it wraps
    ``optimizer.step`` to count its calls): one the guard was not given cannot be restored."""
    return hasattr(optimizer.step, "_wrapped_by_lr_sched")


def warn_scheduler_lead(log: Callable[..., None], taken: int, held: int | None) -> None:
    """The rollback's warning through ``log`` (a logger's ``warning``, or ``debug`` off rank
    0): ``taken`` optimizer steps in this process, ``held`` by the restored weights (None:
    unknown, a checkpoint saved before they were counted)."""
    lead = (
        "how far it runs ahead is unknown: the checkpoint predates the count"
        if held is None
        else f"the optimizer has taken {taken - held} step(s) the weights no longer hold: a "
        "scheduler stepped with it runs that far ahead"
    )
    log(
        "trainguard: an LR scheduler steps this optimizer but the guard does not know it: its "
        "schedule was not rolled back with the weights (%s); pass it as "
        "Guard(..., scheduler=...) to save and restore it too",
        lead,
    )
