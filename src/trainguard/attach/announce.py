"""What ``trainguard run`` says on a process's stderr: its own logger, the line it begins
guarding with (what it guards, the watchdog, what it cannot see)."""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

from trainguard.attach.discovery import describe
from trainguard.step.guard import Guard

ANNOUNCER = "trainguard.run"
"""The logger of ``trainguard run``'s own lines (start-up, standing aside): its own stderr
handler, not propagated, so the script's logging setup neither hides nor doubles them."""

LOSS_SEEN = (
    "it reads the loss the script computes from the model's output; it cannot see uneven "
    "data across ranks"
)
"""The end of the line when the first step's loss was seen."""
UNSEEN = (
    "it cannot see the loss value (none computed from the model's output was seen), loss "
    "spikes or uneven data across ranks"
)
"""The end of the line when it was not (the gradients alone decide)."""


def announcer() -> logging.Logger:
    """The ``trainguard.run`` logger, with its own stderr handler (added once)."""
    log = logging.getLogger(ANNOUNCER)
    if not any(getattr(h, "trainguard_run", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.trainguard_run = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.propagate = False
        log.setLevel(logging.INFO)
    return log


def announce_guarding(
    guard: Guard, optimizer: torch.optim.Optimizer, model: nn.Module, loss_seen: bool
) -> None:
    """The one line a process says when it begins guarding (``loss_seen``: the first step's
    loss was seen)."""
    world = guard.world_size
    timeout = guard.config.hang.timeout
    if not guard.internals.watchdog_on:
        watchdog = "watchdog off" + (" (single process)" if world == 1 else "")
    else:
        watchdog = f"watchdog on (hang timeout {'adaptive' if timeout is None else timeout})"
    step = guard.state.step  # > 0: the script resumed its optimizer (``resumed.py``)
    announcer().info(
        "trainguard run: rank %d: guarding %s, %d rank%s%s, %s, on non-finite: %s, run dir %s; %s",
        guard.rank,
        describe(optimizer, model),
        world,
        "" if world == 1 else "s",
        f", from step {step} (the updates its optimizer's state holds)" if step else "",
        watchdog,
        guard.config.on_nonfinite,
        guard.run_dir,
        LOSS_SEEN if loss_seen else UNSEEN,
    )
