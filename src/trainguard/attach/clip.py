"""Gradient clipping in an unmodified script: ``trainguard run`` checks before the clip.

A script clips its gradients between backward and the optimizer step. The optimizer's step
pre-hook, where ``trainguard run`` checks a step, comes after the clip, and there the
gradients are clipped: the guard's gradient norm (the history, the metrics, the spike rule on
``grad_norm``) is at most ``max_norm`` and hides an explosion, and a NaN in one gradient has
been spread to every gradient by the clip's factor, so the ``nonfinite`` event named every
parameter. So the clipping functions are wrapped (process-wide, under every name torch
exports them: ``clip_grad_norm_``, ``clip_grads_with_norm_``, ``clip_grad_value_`` of
``torch.nn.utils`` and ``torch.nn.utils.clip_grad``): a call over the guarded optimizer's
parameters, after a training forward of the model since its last optimizer step, checks the
step first (what the pre-hook would run), then clips; the step's pre-hook then checks nothing
more. A skipped step's gradients are None: the clip finds nothing to clip (its norm is 0).

Not at the clip (the optimizer step checks, after it, as before):

- the first step: the guard attaches at the first optimizer step;
- a step inside an optimizer closure (Lightning): checked when the closure returns, with the
  loss it returns;
- a process in which an enabled GradScaler has scaled a loss (``GradScaler.scale`` is
  wrapped to notice): an fp16 overflow is the scaler's to skip (``scaler.step`` does not call
  the optimizer then), and before ``scaler.step`` an overflow cannot be told from a bad step;
- a clip that ``torch.compile`` traces (inside a compiled training step).

Every rank makes the same choice: each condition follows the script's code path, not its
values.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import GradScaler

from trainguard.attach.discovery import optimizer_params

CLIPPERS = ("clip_grad_norm_", "clip_grads_with_norm_", "clip_grad_value_")
"""The clipping functions wrapped, in each of ``_namespaces()`` that has them."""


def _namespaces() -> tuple[types.ModuleType, ...]:
    from torch.nn import utils
    from torch.nn.utils import clip_grad

    return (utils, clip_grad)


class ClipWatch:
    """The clip wrappers and the state they read: whether the step is due for a check."""

    def __init__(self) -> None:
        self._check: Callable[[], None] | None = None
        self._param_ids: frozenset[int] = frozenset()
        self._forward_seen = False
        self._checked = False
        self.in_closure = False
        """Set by the attacher while an optimizer closure runs (its own check follows)."""
        self.scaled = False
        """An enabled GradScaler scaled a loss in this process (from then on, for good)."""
        self._restore: list[Callable[[], None]] = []

    # -- what the attacher tells it ----------------------------------------------------------

    def attach(self, optimizer: torch.optim.Optimizer, check: Callable[[], None]) -> None:
        """From now on a clip over ``optimizer``'s parameters runs ``check`` first."""
        self._param_ids = frozenset(optimizer_params(optimizer))
        self._check = check

    def detach(self) -> None:
        """No clip runs a check until the next ``attach`` (the wrappers stay in place: the
        guard is being handed over to a new optimizer's)."""
        self._param_ids, self._check = frozenset(), None

    def forward(self) -> None:
        """A training forward of the guarded model: a step's gradients are being made."""
        self._forward_seen = True
        self._checked = False

    def stepped(self) -> None:
        """The guarded optimizer stepped (its pre-hook took ``_checked``): the next clip is
        the next step's."""
        self._forward_seen = False

    def take_checked(self) -> bool:
        """At the optimizer step: whether the clip already checked this step."""
        checked, self._checked = self._checked, False
        return checked

    # -- installing --------------------------------------------------------------------------

    def install(self) -> None:
        for namespace in _namespaces():
            for name in CLIPPERS:
                original = getattr(namespace, name, None)
                if original is not None:
                    self._replace(namespace, name, self._wrap(original))
        self._replace(GradScaler, "scale", self._wrap_scale(GradScaler.scale))

    def remove(self) -> None:
        """Put every original back (only where the wrapper is still in place)."""
        for restore in reversed(self._restore):
            restore()
        self._restore = []
        self._check = None

    def _replace(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, wrapper)

        def restore() -> None:
            if getattr(owner, name, None) is wrapper:
                setattr(owner, name, original)

        self._restore.append(restore)

    # -- the wrappers ------------------------------------------------------------------------

    def _due(self) -> bool:
        return (
            self._check is not None
            and self._forward_seen
            and not self._checked
            and not self.in_closure
            and not self.scaled
            and not torch.compiler.is_compiling()  # a clip traced by dynamo: the step checks
        )

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        by_value = original.__name__ == "clip_grad_value_"

        @functools.wraps(original)
        def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            if self._due():
                parameters, listed = self._check_before(parameters)
                if by_value and not any(p.grad is not None for p in listed):
                    return None  # a skipped step: torch's clip_grad_value_ raises on no grads
            return original(parameters, *args, **kwargs)

        return clip

    def _check_before(self, parameters: Any) -> tuple[Any, list[Tensor]]:
        """Check the step when ``parameters`` are the guarded optimizer's; returns what to
        hand the original (a generator's items, as a generator again) and the items."""
        generator = isinstance(parameters, types.GeneratorType)
        listed = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        check = self._check
        ids = self._param_ids  # any: a frozen parameter (not the optimizer's) may come first
        if check is not None and any(id(p) in ids for p in listed):
            self._checked = True
            check()
        return ((p for p in listed) if generator else listed), listed

    def _wrap_scale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def scale(scaler: GradScaler, *args: Any, **kwargs: Any) -> Any:
            if not self.scaled and scaler.is_enabled():
                self.scaled = True
            return original(scaler, *args, **kwargs)

        return scale
