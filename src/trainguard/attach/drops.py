"""A step the script leaves out itself, seen by ``trainguard run`` at ``zero_grad``.

``trainguard run`` checks a step in the optimizer's step pre-hook (or at the script's clip).
A script with its own rule, such as ``if torch.isfinite(loss): optimizer.step()``, can leave
the step out on one rank only, the rank whose loss went NaN. Unguarded, the replicas then
silently differ. Guarded, the other ranks wait in the guard's all-reduce while the skipping
rank goes on to its next collective. Gloo then aborts with "a collective mismatch", and NCCL
hangs until its timeout.

So the gradients' clearing is watched: ``zero_grad`` of the guarded optimizer, or of the
model (or of the module DDP wraps), after a backward in a step that no check has taken yet,
means that this rank's loop left the step out. The guard then checks the step there
(``Guard._check_dropped``), in the same all-reduce as the ranks that went on to their
optimizer step. The row says that this rank dropped the step, and every rank decides alike:

- a finite step: ``dropped``, every rank leaves the update out (buffers put back), so the
  replicas stay identical;
- a non-finite one: the usual decision (skip, capture, diagnosis);
- every rank's GradScaler left out an overflowed step: ``overflow``, the scaler's own skip.

"After a backward" is told by the gradients of a few of the optimizer's parameters (the
first, a middle and the last): their tensor (held weakly) and its version counter at the
step's first forward, compared at ``zero_grad``. A backward writes a new gradient or adds to
the old one in place, which both change the pair. So a ``zero_grad`` between the forward and
the backward (``loss = model(x); opt.zero_grad(); loss.backward()``) is not taken for a drop.

Not seen: a rank that leaves the step out without clearing its gradients (the next step then
adds to them: accumulation, as far as anyone can tell), or that calls a collective of its
own before its ``zero_grad``; gradients cleared by hand (``p.grad = None``); a step checked
at the clip and left out after it (the check had passed; ``health.replicas`` sees the
divergence).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from trainguard.step.guard import Guard

Mark = tuple["weakref.ReferenceType[Tensor]", int] | None


def _mark(param: nn.Parameter) -> Mark:
    grad = param.grad
    return None if grad is None else (weakref.ref(grad), grad._version)


def _same(marks: list[Mark], params: list[nn.Parameter]) -> bool:
    """Whether each parameter's gradient is the one marked, at the same version."""
    for mark, param in zip(marks, params, strict=True):
        grad = param.grad
        if mark is None or grad is None:
            if (mark is None) != (grad is None):
                return False
        elif mark[0]() is not grad or mark[1] != grad._version:
            return False
    return True


def _samples(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The first, a middle and the last parameter the optimizer updates."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    picked = {0, len(params) // 2, len(params) - 1} if params else set()
    return [params[i] for i in sorted(picked)]


def _defining_class(obj: object, name: str) -> type:
    return next(cls for cls in type(obj).__mro__ if name in vars(cls))


class DropWatch:
    """Watches the guarded optimizer's and model's ``zero_grad`` for a step left out."""

    def __init__(self) -> None:
        self._guard: Guard | None = None
        self._owners: tuple[object, ...] = ()
        self._samples: list[nn.Parameter] = []
        self._scaled: Callable[[], bool] = lambda: False
        self._marked_step = -1
        self._marks: list[Mark] = []
        self.busy = False
        """Set while the guard checks a step: its own ``zero_grad`` (a skip) is no drop."""
        self._carried = False
        """The step's first forward cleared a skip's given-back gradients, and no
        ``zero_grad`` of the loop's came since (``checking`` says so)."""
        self._restore: list[Callable[[], None]] = []

    def attach(
        self,
        guard: Guard,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        scaled: Callable[[], bool],
    ) -> None:
        """Watch ``optimizer``'s and ``model``'s ``zero_grad`` from now on. ``scaled``: whether
        an enabled GradScaler scales the loss in this process (``ClipWatch.scaled``)."""
        self._guard, self._scaled = guard, scaled
        inner = getattr(model, "module", None)
        self._owners = (optimizer, model) + ((inner,) if isinstance(inner, nn.Module) else ())
        self._samples = _samples(optimizer)
        for owner in (optimizer, model):
            self._wrap(_defining_class(owner, "zero_grad"))

    def forward(self) -> None:
        """A training forward of the guarded model: a skip's given-back gradients the loop
        left on are cleared; at the step's first, the gradients are marked."""
        guard = self._guard
        if guard is not None and guard.internals.clear_carried_gradients():
            self._carried = True
        if guard is not None and guard.state.step != self._marked_step:
            self._marked_step = guard.state.step
            self._marks = [_mark(p) for p in self._samples]

    def checking(self) -> None:
        """The guard checks the step from now until ``busy`` is False again: a loop that
        reached the check with gradients cleared at its forward and no ``zero_grad`` since
        carries gradients across optimizer steps (one that zeroes them after its forward,
        as PyTorch's ImageNet example does, is not told so)."""
        self.busy = True
        guard = self._guard
        if self._carried and guard is not None:
            self._carried = False
            guard.internals.say_carried()

    def remove(self) -> None:
        """Put the original ``zero_grad`` methods back and stop watching."""
        for restore in reversed(self._restore):
            restore()
        self._restore = []
        self._guard = None
        self._owners, self._samples, self._marks = (), [], []  # the script's objects: let go

    def _wrap(self, cls: type) -> None:
        original = vars(cls)["zero_grad"]
        if getattr(original, "trainguard_drops", None) is self:
            return  # the optimizer's and the model's class are one (a module that optimizes)

        @functools.wraps(original)
        def zero_grad(owner: Any, *args: Any, **kwargs: Any) -> Any:
            if owner in self._owners:  # by identity: modules and optimizers compare so
                self._before_zero_grad()
            return original(owner, *args, **kwargs)

        zero_grad.trainguard_drops = self  # type: ignore[attr-defined]
        setattr(cls, "zero_grad", zero_grad)  # noqa: B010

        def restore() -> None:
            if vars(cls).get("zero_grad") is zero_grad:
                setattr(cls, "zero_grad", original)  # noqa: B010

        self._restore.append(restore)

    def _before_zero_grad(self) -> None:
        guard = self._guard
        if guard is None or self.busy:
            return
        self._carried = False  # the loop clears its gradients itself
        step = guard.state.step
        if self._marked_step != step or guard.internals.started_step() != step:
            return  # no training forward since the last check: nothing left out
        if _same(self._marks, self._samples):
            return  # no backward since the step's first forward
        self.busy = True
        try:
            guard.internals.check_dropped(self._scaled())
        finally:
            self.busy = False
            guard.internals.give_back_gradients()  # nothing steps here; the script clears
