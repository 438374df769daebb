"""A second optimizer over the rest of the guarded model: part of the guarded step.

One model, two optimizers over disjoint parts of it (Muon over the matrices of its blocks,
AdamW over the embeddings, the head and the gains: nanochat, modded-nanogpt). The guard
attaches to the optimizer that steps first; the check at its step (or at the script's clip)
reads every gradient of the model, the other optimizer's too, so its decision covers both
updates. An optimizer is a companion when every parameter it updates belongs to the guarded
model and none is the guarded optimizer's. It steps after the check, in the same step: on a
dropped step (skip, spike, escalation) its parameters' gradients are held back for its
``step()`` (the guard gave the model's back after the guarded optimizer's step: the script
may read them) and given back after it, so neither optimizer updates anything. One that
steps before the guarded optimizer in a step (before any check) is not part of a checked
step, nor is any under a GradScaler (its overflow skips each optimizer on its own): there
``trainguard run`` stands aside, as for any second optimizer.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from trainguard.attach.discovery import over_the_rest


class Companions:
    """The companions of the guarded optimizer and the state of the step they join."""

    def __init__(self) -> None:
        self._known: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = (
            weakref.WeakKeyDictionary()
        )
        self._checked = False
        """The step was checked since the model's last training forward."""
        self._dropped = False
        """That check dropped the step's update."""
        self._held: list[tuple[nn.Parameter, Tensor]] = []

    def forward(self) -> None:
        """A training forward of the model: a new step (or micro-batch) begins."""
        self._checked = False

    def checked(self, applied: bool) -> None:
        """The step's check ran: its update is applied, or dropped."""
        self._checked, self._dropped = True, not applied

    def join(
        self,
        optimizer: torch.optim.Optimizer,
        guarded: torch.optim.Optimizer,
        model: nn.Module | None,
        scaled: bool,
    ) -> bool:
        """At ``optimizer``'s step (not the guarded one's): whether it is a companion
        stepping in a checked step; if so and the step was dropped, its parameters'
        gradients are held back until ``stepped``. Never under a GradScaler (``scaled``):
        its overflow skips each optimizer on its own, and the check at the first one's step
        reads the second one's gradients still scaled."""
        if not self._checked or scaled or model is None:
            return False
        if not self._is_companion(optimizer, guarded, model):
            return False
        if self._dropped:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self._held = [(p, p.grad) for p in params if p.grad is not None]
            for param, _ in self._held:
                param.grad = None
        return True

    def stepped(self) -> None:
        """After a companion's step: the gradients held back are the script's again."""
        for param, grad in self._held:
            if param.grad is None:
                param.grad = grad
        self._held = []

    def _is_companion(
        self, optimizer: torch.optim.Optimizer, guarded: torch.optim.Optimizer, model: nn.Module
    ) -> bool:
        known = self._known.get(optimizer)
        if known is None:
            known = self._known[optimizer] = over_the_rest(optimizer, guarded, model)
        return known
