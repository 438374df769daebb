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

from trainguard.attach.discovery import optimizer_params
from trainguard.attach.prestart import StepZero
from trainguard.step.guard import Guard


def made_anew(new: torch.optim.Optimizer, guarded: torch.optim.Optimizer, model: nn.Module) -> bool:
    """Whether ``new`` updates every parameter ``guarded`` does and only ``model``'s."""
    updates = optimizer_params(new)
    return updates >= optimizer_params(guarded) and updates <= {id(p) for p in model.parameters()}


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
    guard._load_state(state)  # the run goes on: no "state_loaded", where a run would begin
    adopt_start(guard, start, step)
    # a step the old guard skipped at the script's clip: its gradients go back after the
    # new optimizer's step, as after any skipped step (the attacher's post-step hook)
    guard._drop_update.dropped = old._drop_update.dropped
    return guard


def step_start(guard: Guard) -> StepZero | None:
    """The start of ``guard``'s step in progress, as its forward hook recorded it (None when
    it saw none)."""
    start = guard._start
    if start.step != guard.state.step or start.autocast is None:
        return None
    rng = start.rng  # the snapshot's states (built now, once)
    if rng is None:
        return None
    return StepZero(guard.model, rng, start.autocast, start.buffers, guard._recorded)


def adopt_start(guard: Guard, start: StepZero | None, step: int) -> None:
    """Hand the start of ``step`` (recorded before this guard existed: ``trainguard run``'s
    first step, or the old guard's of a replaced optimizer) to ``guard``, as if its own
    ``StepStart`` had seen that forward: buffers, RNG, autocast, micro-batches."""
    if start is None or guard.state.step != step:
        return
    record = guard._start  # the guard's step-start record (step/start.py)
    if guard.config.restore_buffers:
        record.buffers = start.buffers
    record.step, record.rng, record.autocast, record.seen = step, start.rng, start.autocast, True
    guard._recorded.adopt(start.recorded, step)
