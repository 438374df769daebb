"""Where a script's own resume left its optimizer: ``trainguard run`` counts on from there.

A script that torchrun restarts usually loads its own checkpoint (weights, optimizer state,
epoch) and trains on from it. ``trainguard run`` attaches anew in the restarted processes and
sees none of that: its step count began at 0 again, so the events, metrics and captures of
the second start were numbered over the first one's, and the report counted every step of
the second start as "run again after restarts" (PyTorch's minGPT-ddp example, restarted by
torchrun in its second epoch, was reported as running its first epoch twice).

The optimizer's state says where the script resumed: Adam, AdamW, RMSprop, Adagrad and the
like count their updates in each parameter's state (``"step"``), saved and loaded with
``optimizer.state_dict()``. At attach (the first optimizer step, before it updates anything)
each rank reads its optimizer's count (``updates_of``) and the ranks exchange it in the
attach all-gather they already make (``leaving.agree_at_attach``). Then:

- the same count ``N > 0`` on every rank: the guard's step goes on from ``N``
  (``Guard.load_state_dict({"step": N})``, the path of a loop that hands the guard its own
  iteration count): its events, metrics and captures are numbered on from the checkpoint,
  and the report counts a start that began at ``N``; the spike rule's statistics are
  learned again from the run's metrics log (``spike_history.py``). ``N`` counts the updates
  applied before the checkpoint: steps skipped then (by a GradScaler, or by the guard) are
  not in it;
- counts that differ between ranks: the ranks loaded different optimizer states (one rank
  did not find the checkpoint, on a disk the others do not share). Every rank says so in one
  line and a ``resume_mismatch`` event naming each rank's count, and counts from 0; the
  script runs on as it would bare;
- no count (SGD keeps none, or the parameters' counts differ) or 0 on every rank: from 0.

A guard whose step is already past 0 when it attaches (a state of its own restored) keeps
it. (``trainguard run`` refuses ``-o recovery.resume=true``: its resume acts at
``guard.watch()``'s step boundary, which the script's own loop never reaches; ``options.py``.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from trainguard.attach.announce import announcer
from trainguard.attach.spike_history import resume_spikes
from trainguard.step.guard import Guard

MISMATCH = "resume_mismatch"
"""The event of ranks whose optimizers hold different update counts at attach."""


def updates_of(optimizer: torch.optim.Optimizer) -> int | None:
    """The updates the optimizer's own state counts: the ``"step"`` every parameter's state
    holds alike; 0 before any state exists; None without such a count (SGD) or when the
    parameters' counts differ (a group added later), or are not plain numbers and tensors."""
    steps = []
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if step is None:
            return None
        steps.append(step)
    try:
        counts = {int(value) for value in _host_values(steps)}
    except (TypeError, ValueError, RuntimeError):
        return None
    if not counts:
        return 0
    return counts.pop() if len(counts) == 1 else None


def _host_values(steps: list[Any]) -> list[float]:
    """The counts as host numbers, one read per device (a fused or capturable optimizer keeps
    them on the accelerator: a read each would be a device sync each). A tensor subclass
    (a DTensor) raises TypeError: its reads may be collectives, and it tells nothing."""
    values: list[float] = []
    on_device: dict[torch.device, list[Tensor]] = {}
    for step in steps:
        if isinstance(step, Tensor):
            if type(step) is not Tensor and not isinstance(step, nn.Parameter):
                raise TypeError(f"a {type(step).__name__} step count")
            on_device.setdefault(step.device, []).append(step.detach().reshape(()).double())
        else:
            values.append(float(step))
    for tensors in on_device.values():
        values += torch.stack(tensors).tolist()
    return values


def go_on(guard: Guard, counts: list[int | None]) -> int:
    """Set ``guard``'s step from every rank's count (agreed: ``counts`` is the all-gather's,
    the same list on every rank) and return it: the common count, else 0, said when the
    ranks' counts differ. A guard whose step is already past 0 (a state of its own
    restored, the same on every rank) keeps its step."""
    if guard.state.step:
        return guard.state.step
    if len(set(counts)) > 1:
        guard.events.write(MISMATCH, guard.state.step, updates=counts)
        announcer().warning(
            "trainguard run: rank %d: the ranks' optimizers hold different update counts "
            "(%s): they loaded different states, as when one rank did not find the script's "
            "checkpoint; the guard counts steps from %d",
            guard.rank,
            ", ".join(f"rank {r}: {'none' if c is None else c}" for r, c in enumerate(counts)),
            guard.state.step,
        )
        return guard.state.step
    common = counts[0] if counts else None
    if common:  # the same on every rank: the spike statistics, from the run's metrics log
        resume_spikes(guard, common)
    return guard.state.step
