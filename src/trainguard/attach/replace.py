"""An optimizer the script makes anew mid-run: ``trainguard run`` guards the new one.

Scripts make their optimizer again: after unfreezing a backbone (a new optimizer over every
parameter), at each epoch, after a learning-rate finder. ``trainguard run`` guards the
optimizer of the first step; before this module it stood aside when another one stepped,
and the rest of the run went unguarded.

A new optimizer that updates every parameter the guarded one did, and only the guarded
model's (``made_anew``), is the same training going on: at its first step, on every rank
(each runs the same script to the same line), the guard is handed over
(``hand_over``): an ``optimizer_replaced`` event, the old guard closed, a new one made over
the new optimizer on the same run (the same run id: one run in the report, its counters
and step carried by ``state_dict``), and the start of the step in progress (its RNG states,
buffers and micro-batches, recorded by the old guard at its forward) carried over, so this
step is checked, skipped and captured as any other. An optimizer over other parameters (a
GAN's second one, a head alone) is still refused: the guard checks one optimizer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from trainguard.attach.discovery import model_params, optimizer_params
from trainguard.attach.prestart import StepZero
from trainguard.step.guard import Guard
from trainguard.step.internals import StartRecord


def made_anew(new: torch.optim.Optimizer, guarded: torch.optim.Optimizer, model: nn.Module) -> bool:
    """Whether ``new`` updates every parameter ``guarded`` does and only ``model``'s."""
    updates = optimizer_params(new)
    return updates >= optimizer_params(guarded) and updates <= model_params(model)


HANDOVER: dict[str, object] = {"handover": "optimizer_replaced"}
"""The successor's ``start`` event carries this (``GuardConfig.extra``): the report counts
it as the same start going on, not a restart (``report/starts.py``, ``report/runs.py``)."""


def hand_over(
    old: Guard, new: torch.optim.Optimizer, successor: Callable[[str | None], Guard]
) -> Guard:
    """Close ``old`` and return ``successor(run_id)``, the guard of ``new`` on the same run
    (made with ``extra=HANDOVER``), with ``old``'s state and the start of the step in
    progress. ``successor`` may raise (then ``old`` is closed and nothing else changed)."""
    step = old.state.step
    old.events.write(
        "optimizer_replaced",
        step,
        old=type(old.optimizer).__name__,
        new=type(new).__name__,
        parameters=len(optimizer_params(new)),
        guarded_parameters=len(optimizer_params(old.optimizer)),
    )
    state, start = old.state_dict(), step_start(old)
    run = old.events.run.id if old.events.run is not None else None
    old.close()
    guard = successor(run)
    guard.internals.load_state_quietly(state)  # the run goes on: no "state_loaded"
    adopt_start(guard, start, step)
    # a step the old guard skipped at the script's clip: its gradients go back after the
    # new optimizer's step, as after any skipped step (the attacher's post-step hook)
    guard.internals.take_held_gradients(old)
    return guard


def step_start(guard: Guard) -> StartRecord | None:
    """The start of ``guard``'s step in progress, as its forward hook recorded it (None when
    it saw none)."""
    return guard.internals.start_record()


def adopt_start(guard: Guard, start: StartRecord | StepZero | None, step: int) -> None:
    """Hand the start of ``step`` (recorded before this guard existed: ``trainguard run``'s
    first step, or the old guard's of a replaced optimizer) to ``guard``, as if its own
    ``StepStart`` had seen that forward: buffers, RNG, autocast, micro-batches."""
    if start is None or guard.state.step != step:
        return
    if isinstance(start, StepZero):
        start = StartRecord(start.rng, start.autocast, start.buffers, start.recorded, start.draws)
    guard.internals.adopt_start(start, step)
