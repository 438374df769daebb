"""Every rank of a job stands aside together: ``trainguard run``'s own decisions, agreed.

``trainguard run`` decides in each process whether it can guard the script: the model found,
no guard of the script's own, one optimizer, no LBFGS. A decision one
rank takes alone splits the job. Rank 0 of a DDP job that trains a linear probe of its own
with a second optimizer stood aside at the probe's first step and stopped joining the
guard's all-reduce, while rank 1 waited in it: the next collective of the script was a
collective mismatch (gloo aborted both ranks); the bare script ran to its end. So in a job
of several ranks these decisions are agreed too:

- **at attach** (every rank's first optimizer step, before any guard exists): each rank's
  verdict (None, or why it cannot be guarded: no model found, a guard of the script's own,
  LBFGS) goes round in one small all-gather with its optimizer's update count
  (``agree_at_attach``; once a run; the count: ``resumed.py``). When any rank cannot be
  guarded, every rank stands aside, each line naming the rank and its reason
  (``agreed_reason``);
- **once guarded**: the rank that finds a reason goes on guarding its optimizer and says so in
  the row of its next check (``StepCall.leaving``, one column of the step's all-reduce: no
  collective of its own). Every rank reads it in that step's agreement
  (``GuardState.leaving_ranks``) and stands aside after that step, with the same decision
  applied everywhere. The steps of the second optimizer meanwhile run unguarded, as they
  would after standing aside.

A process alone stands aside at once, as before; so does every rank of a script that updates
its parameters by hand (it reaches no optimizer step to agree at, on any rank).

Standing aside happens inside the optimizer's step hooks, while torch iterates its
process-wide dict of them: our hooks there are made inert (``disarm``), not deleted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from trainguard.distributed.objects import all_gather_objects
from trainguard.step.consensus import buffer_device

UNGUARDED = "the script runs unguarded"


@dataclass(frozen=True)
class AsideReason:
    """Why a process stands aside, and what follows, as its one line says them."""

    reason: str
    then: str = UNGUARDED
    own_guard: bool = False
    """The script's own guard keeps the run (``status.write_reason``'s ``guarded``)."""
    origin: int | None = None
    """The rank that found it, when another rank's (None: this process's own)."""

    @property
    def said(self) -> str:
        """The reason as this process's line says it: another rank's named."""
        return self.reason if self.origin is None else f"rank {self.origin}: {self.reason}"


def agree_at_attach(
    mine: AsideReason | None, updates: int | None, device: torch.device
) -> list[tuple[AsideReason | None, int | None]]:
    """Every rank's verdict and optimizer update count at attach, in rank order (one
    all-gather over the default group, on its collective's device: ``device`` is the
    optimizer's, for a process group of none)."""
    return all_gather_objects((mine, updates), None, buffer_device(None, device))


def agreed_reason(verdicts: list[AsideReason | None], rank: int) -> AsideReason | None:
    """The reason this rank stands aside with: its own when it has one, else the first
    rank's that has one, named; None when every rank can be guarded."""
    own = verdicts[rank]
    if own is not None:
        return own
    for other, verdict in enumerate(verdicts):
        if verdict is not None:
            return AsideReason(verdict.reason, verdict.then, verdict.own_guard, origin=other)
    return None


def peer_reason(ranks: list[int]) -> AsideReason:
    """The reason of a rank that stands aside because other ranks do, once guarded (their
    own lines say why: the row carries the fact, not the text)."""
    names = ", ".join(str(rank) for rank in ranks)
    which = f"rank {names}" if len(ranks) == 1 else f"ranks {names}"
    return AsideReason(
        f"{which} found a loop it cannot guard (its own line says why), and every rank stops "
        "guarding at the same step"
    )


def _inert(*args: Any) -> None:
    """A hook that does nothing and holds nothing (``disarm``)."""


def disarm(handle: RemovableHandle) -> None:
    """Take an optimizer step hook of ours out of torch's process-wide dict by making it
    inert, not by deleting it: the guard stands aside from inside those hooks, while torch
    iterates that dict, and a deletion there ends the script's step with "OrderedDict mutated
    during iteration" as soon as another library's hook follows ours."""
    hooks = handle.hooks_dict_ref()
    if hooks is not None and handle.id in hooks:
        hooks[handle.id] = _inert
