"""What a step of an optimizer other than the guarded one, or one before the first training
forward, means for ``trainguard run`` (``hooks.Attacher``): a step to wait out, or the reason
in the line it stands aside with. Pure functions of the optimizers, no hooks."""

from __future__ import annotations

import torch
from torch import nn

from trainguard.attach.discovery import optimizer_params, over_the_rest
from trainguard.attach.leaving import AsideReason

LBFGS_REASON = (
    "LBFGS evaluates its closure several times per step",
    "the script runs unguarded (to guard such a loop, use trainguard.Guard in the script and "
    "check the closure's first loss: loss = closure(); if guard.check(loss): "
    "optimizer.step(closure))",
)
"""``stand_aside``'s reason and what follows, for ``torch.optim.LBFGS``."""


def manual_update_reason(described: str) -> str:
    """Why a module whose parameters changed between two training forwards with no optimizer
    step (``described``: ``discovery.describe_module``'s words) cannot be guarded."""
    return (
        f"the script updates the parameters of {described} by hand (they changed between two "
        "training forwards with no torch.optim optimizer step), and trainguard run checks "
        "each step at its optimizer's step(); use a torch.optim optimizer "
        "(torch.optim.SGD(model.parameters(), lr=LR) makes the same update as p -= LR * p.grad)"
    )


NEVER_STEPPED_REASON = (
    "the script ran training forwards but no torch.optim optimizer step: trainguard run checks "
    "each step at its optimizer's step()",
    "nothing was guarded",
)
"""``stand_aside``'s reason and what follows, for a process that trained but never stepped."""


def never_stepped(trained: bool, thread: str | None) -> tuple[str, str] | None:
    """At exit, for a process that never reached an optimizer step: the reason it stands
    aside with (it ran training forwards, or ``thread`` did), None when it trained nothing."""
    if trained:
        return NEVER_STEPPED_REASON
    return None if thread is None else other_thread_reason(thread)


def own_guard_reason(described: str, hook: str) -> AsideReason:
    """Why a model (``described``) whose hooks show a guard of the script's own (``hook``: its
    kind) is not guarded again: that guard keeps the run."""
    return AsideReason(
        f"{described} already has a trainguard guard (a {hook} hook: Lightning's TrainGuard, "
        "the HF TrainGuardCallback or a Guard in the script)",
        then="the script's own guard keeps the run",
        own_guard=True,
    )


def other_thread_reason(thread: str) -> tuple[str, str]:
    """``stand_aside``'s reason and what follows, for a process whose training forwards ran
    only in a thread other than the main one (``thread``): torch.distributed.rpc's trainers
    run in its handler threads (PyTorch's ``ddp_rpc`` example, with a
    ``DistributedOptimizer``)."""
    return (
        f"the script trains in a thread other than the main one ({thread}: "
        "torch.distributed.rpc's handlers, or a thread of its own), and trainguard run "
        "follows the main thread's loop",
        "nothing was guarded (to guard it, put a trainguard.Guard in the function that "
        "trains: docs/guard.md)",
    )


def model_not_found(reason: str, thread: str | None) -> str:
    """Why the first step found no model: ``reason`` (``discovery.find_model``'s), or, when
    the main thread ran no training forward and ``thread`` did, that thread."""
    return other_thread_reason(thread)[0] if thread else f"cannot find the model: {reason}"


def second_optimizer_reason(
    new: torch.optim.Optimizer, guarded: torch.optim.Optimizer, model: nn.Module | None = None
) -> str:
    """Why an optimizer other than the guarded one stepping ends the guarding (one made anew
    over the guarded model's parameters is followed instead: ``replace.py``): one over every
    guarded parameter and others outside the guarded model, one over the guarded model's
    other parameters (one model, two optimizers: Muon beside AdamW), or one over part of
    them."""
    new_name, guarded_name = type(new).__name__, type(guarded).__name__
    if optimizer_params(new) >= optimizer_params(guarded):
        return (
            f"a new optimizer ({new_name}) over every guarded parameter and parameters "
            f"outside the guarded model steps instead of, or besides, the guarded "
            f"{guarded_name}: trainguard run follows an optimizer made anew over the same "
            "model only (use trainguard.Guard in the script)"
        )
    if model is not None and over_the_rest(new, guarded, model):
        return (
            f"a second optimizer ({new_name}) updates other parameters of the model the "
            f"guarded {guarded_name} updates, in a step the guard had not checked or under a "
            f"GradScaler (trainguard run guards such a one in the step its {guarded_name} just "
            "stepped in, after it, without a GradScaler): "
            f"to guard both, put guard = trainguard.Guard(model, {guarded_name.lower()}, "
            f"extra_state={{'{new_name.lower()}': {new_name.lower()}}}) in the script and step "
            "both optimizers when guard.check(loss) passes (docs/guard.md, 'One model, several "
            "optimizers')"
        )
    return (
        f"a second optimizer ({new_name}) steps besides the guarded {guarded_name}: "
        "trainguard run guards scripts with one optimizer (to guard a GAN's or an "
        "actor-critic's updates, put a trainguard.Guard per model and optimizer in the "
        "script, each checked before its own step: docs/guard.md, 'Several models, "
        "several guards')"
    )


def updates_nothing(optimizer: torch.optim.Optimizer) -> bool:
    """A step of ``optimizer`` would change no weight: no parameter has a gradient, or every
    param group's learning rate is 0 (``_at_rate_zero``)."""
    return not _has_gradients(optimizer) or _at_rate_zero(optimizer)


def _has_gradients(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _at_rate_zero(optimizer: torch.optim.Optimizer) -> bool:
    """Every param group's learning rate is 0: a step that makes the optimizer's state and
    updates nothing. ``torch.distributed.checkpoint``'s ``set_optimizer_state_dict`` steps an
    optimizer without state so, on zero gradients, before it loads one (PyTorch's FSDP2
    example resumes that way before its first forward, on every rank alike: it is
    collective); the training steps come after. An lr that is no number: not zero."""
    try:
        return all(float(group.get("lr", 1.0)) == 0.0 for group in optimizer.param_groups)
    except (TypeError, ValueError, RuntimeError):
        return False
