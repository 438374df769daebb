"""Before the guard exists: the first step's start, recorded for whichever module is the model.

The guard is made at the first optimizer step, after that step's forward ran. So until then
two process-wide module hooks (``register_module_forward_pre_hook`` and an ``always_call``
forward hook) find the *outermost* module calls (depth 0, main thread, gradients on, module
in training mode, or a wrapper around one: ``discovery.in_training``) and record, per
module, what the guard's ``StepStart`` records at a step's first forward: the RNG states
(read, not drawn), the autocast state, a copy of the buffers (``BufferKeeper``), and every
call's arguments, positional and keyword (the micro-batches). At the first optimizer step
the model's record is handed to the guard and these hooks are removed: after that no module
call but the model's own pays anything.

A script that updates its parameters by hand (``p.data.add_(p.grad, alpha=-lr)``, no
``torch.optim`` optimizer) never reaches that first step. So each recorded module keeps a
sample of its parameters' values from its first training call (a few values of each of its
first parameters); when a later top-level training call finds them changed with no
optimizer step in between, ``on_manual_update`` is told at once (``trainguard run`` then
says so and stands aside). Gradient accumulation changes no parameter between its calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle

from trainguard.attach.compile_warning import QuietCompileWarning
from trainguard.attach.discovery import in_training
from trainguard.attach.loss_inputs import LossInputs
from trainguard.capture.batchtree import call_batch as batch_of
from trainguard.capture.rng import rng_state
from trainguard.step.buffers import BufferKeeper
from trainguard.step.recorded_batches import RecordedBatches
from trainguard.step.step_start import autocast_state
from trainguard.step.types import ForwardDraws, IndicesOf
from trainguard.user_hooks import in_backward

MAX_CANDIDATES = 8
"""Distinct top-level modules recorded before the first step (the rest are ignored)."""
SAMPLED_PARAMS = 16
"""Parameters (the first ones with values) whose first values are sampled per module."""
SAMPLED_VALUES = 8
"""Values sampled of each."""


def parameter_sample(module: nn.Module) -> list[Tensor]:
    """A few values of each of the module's first parameters, copied (a manual update of
    the parameters changes them: ``PreStart``). Lazy (not materialised) and meta parameters
    are passed over."""
    sample = []
    for param in module.parameters():
        if is_lazy(param) or param.is_meta or not param.numel():
            continue
        sample.append(param.detach().reshape(-1)[:SAMPLED_VALUES].clone())
        if len(sample) == SAMPLED_PARAMS:
            break
    return sample


def sample_changed(module: nn.Module, zero: StepZero) -> bool:
    """Whether the parameters' sampled values differ from ``zero.sample`` (NaN-aware). A
    sample that cannot be compared (lazy parameters materialised since, the module moved to
    another device or dtype) is taken again instead: never a finding, never an error in the
    user's forward."""
    try:
        now = parameter_sample(module)
        comparable = len(now) == len(zero.sample) and all(
            (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
            for a, b in zip(now, zero.sample, strict=True)
        )
        if not comparable:
            zero.sample = now
            return False
        return not all(_same(a, b) for a, b in zip(now, zero.sample, strict=True))
    except Exception:  # a module of unusual parameters: no finding
        return False


def _same(a: Tensor, b: Tensor) -> bool:
    return bool((a.eq(b) | (a.isnan() & b.isnan())).all())


@dataclass
class StepZero:
    """What the first step's forward of one top-level module started from."""

    module: nn.Module
    rng: dict[str, Any]
    autocast: dict[str, Any]
    buffers: BufferKeeper
    recorded: RecordedBatches = field(default_factory=RecordedBatches)
    """The step's micro-batches (a refilled input buffer detected as the guard does)."""
    sample: list[Tensor] = field(default_factory=list)
    """``parameter_sample`` at its first training call."""
    draws: list[IndicesOf | None] = field(default_factory=list)
    """Per micro-batch of ``recorded``: what names its samples' dataset indices
    (``PreStart``'s ``loader_draws``; empty without it)."""

    @property
    def batches(self) -> list[Any]:
        return self.recorded.current


class PreStart:
    """The process-wide hooks that record the first step's top-level module calls."""

    def __init__(
        self,
        on_manual_update: Callable[[nn.Module], None] | None = None,
        loader_draws: ForwardDraws | None = None,
    ) -> None:
        self.on_manual_update = on_manual_update
        """Told of a recorded module whose parameters changed between two training calls
        with no optimizer step (the module docstring)."""
        self.loader_draws = loader_draws
        """Gives, at a recorded call, what names its samples' dataset indices
        (``loader_draws.LoaderDraws.at_forward``): the first step's bad sample is named as a
        later step's is."""
        self.calls: dict[int, StepZero] = {}
        self.loss_inputs = LossInputs()
        """The first step's loss call adds its targets to the micro-batch (``loss_inputs``)."""
        self._depth = 0
        self._traced = 0
        """Calls inside a compile wrapper that ``_pre`` left alone and ``_post`` has not seen."""
        self._main = threading.main_thread()
        self.other_thread: str | None = None
        """The name of a thread other than the main one that ran a training forward (its
        calls are not recorded: the guard follows the main thread's loop)."""
        self._handles: list[RemovableHandle] = []
        self._quiet = QuietCompileWarning()
        self._recording: StepZero | None = None
        """The record of the top-level call in progress (its batch is taken at its end)."""

    def install(self) -> None:
        self._quiet.quiet()  # torch.compile's warning about these hooks (compile_warning.py)
        self._handles = [
            module_hooks.register_module_forward_pre_hook(self._pre),
            module_hooks.register_module_forward_hook(
                self._post, with_kwargs=True, always_call=True
            ),
        ]

    def remove(self) -> None:
        self.loss_inputs.disarm()
        with_kwargs = getattr(module_hooks, "_global_forward_hooks_with_kwargs", {})
        for handle in self._handles:
            handle.remove()
            # torch's handle leaves this entry behind (2.13): ``_has_any_global_hook()`` then
            # stays true, every module call in the process keeps the slow path with hooks,
            # and torch.compile warns of global hooks at every step
            with_kwargs.pop(handle.id, None)
        self._handles = []
        self._quiet.restore()

    @property
    def candidates(self) -> list[nn.Module]:
        """The modules called at the top level, first call first."""
        return [zero.module for zero in self.calls.values()]

    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if torch.compiler.is_compiling() and self._depth > 0:
            # a call inside a torch.compile wrapper whose own call was recorded eagerly: not
            # top level, and nothing here for dynamo to trace (it cannot trace the thread
            # check, and warned of it at the first step)
            self._traced += 1
            return
        if in_backward():  # a recomputed forward (activation checkpointing): no call
            return
        if threading.current_thread() is not self._main:
            if self.other_thread is None and torch.is_grad_enabled() and in_training(module):
                self.other_thread = threading.current_thread().name
            return
        self._depth += 1
        if self._depth != 1 or not torch.is_grad_enabled() or not in_training(module):
            return
        self.loss_inputs.release()  # the last call's graph is not held through this one
        zero = self.calls.get(id(module))
        if zero is None:
            if len(self.calls) >= MAX_CANDIDATES:
                return
            zero = self._start(module)
            self.calls[id(module)] = zero
        elif self.on_manual_update is not None and sample_changed(module, zero):
            self.on_manual_update(module)
            return
        self._recording = zero  # its micro-batch: when the call ends (``_post``)

    def _post(self, module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        """The end of a call: a recorded top-level call's micro-batch is taken here, where a
        process-wide hook sees the keyword arguments too (``_pre`` sees the positional
        ones only). ``rest``: ``(kwargs, output)``; ``(None,)`` when the call raised (torch
        calls an ``always_call`` global hook without the keyword arguments then: a
        checkpointed forward's early stop, a forward out of memory that the loop retries),
        and the call records nothing."""
        if self._traced and torch.compiler.is_compiling():
            self._traced -= 1  # the end of a call _pre left alone
            return
        if in_backward():
            return
        if threading.current_thread() is self._main and self._depth > 0:
            recording = self._recording
            if self._depth == 1 and recording is not None:
                self._recording = None
                if len(rest) == 2:
                    kwargs, output = rest
                    recording.recorded.record(batch_of(args, kwargs), 0)
                    if self.loader_draws is not None:
                        recording.draws.append(self.loader_draws(args, kwargs))
                    self.loss_inputs.arm(output, recording.recorded, 0, module)
            self._depth -= 1

    @staticmethod
    def _start(module: nn.Module) -> StepZero:
        param = next(module.parameters(), None)
        device_type = param.device.type if param is not None else "cpu"
        keeper = BufferKeeper(module)
        keeper.begin(0)
        zero = StepZero(module, rng_state(), autocast_state(device_type), keeper)
        try:
            zero.sample = parameter_sample(module)
        except Exception:  # unusual parameters: no sample, no finding
            zero.sample = []
        return zero
