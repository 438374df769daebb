"""The targets of ``loss = criterion(model(x), y)`` and ``F.cross_entropy(model(x), y)``,
kept beside the model's input.

``trainguard run`` records a step's micro-batch where the model is called: its inputs. The
loss often takes more (the targets, a mask), and a replay without them had to invent them.
So after each training call of the model, ``LossInputs.arm`` follows the model's output to
the loss, and the micro-batch becomes ``(inputs, *loss_inputs)``: what a replay factory's
``loss_fn(model, batch)`` takes apart as ``x, y = batch``. Two followers, armed together:

- **A loss module** (``nn.CrossEntropyLoss()(out, y)``): a process-wide module pre-hook.
  The first module call outside the model handed the output (the tensor itself, a view of
  it, or a tensor of a tuple or dict output) is the loss; its other tensor arguments are
  its inputs.
- **A loss function** (``F.cross_entropy(out.view(-1, V), y.view(-1))``, ``((out - y) **
  2).mean()``): a ``TorchFunctionMode`` (``_LossCalls``) sees the torch calls that take the
  output or a tensor computed from it. Each such call's other tensors that need no gradient
  (targets, masks: not parameters) are the loss's inputs; its result, while it needs a
  gradient, is followed on; the first 0-d result that needs a gradient is the loss, and the
  follower stops there (at ``backward()`` at the latest). It calls every function as it was
  called and returns its result untouched.

Once one of them found the loss, it alone is armed after the next calls of the model (a
loop's loss is computed the same way every step); a miss arms both again, and a loop whose
loss neither sees (eight misses in a row) has them tried once every hundred calls only
(``LossInputs._learn``): the follower not needed costs nothing. Both stop at the first
loss found, at the model's next call or the optimizer step
(``disarm``): the modules and ops inside the model's forward never see them, and the rest
of the step costs nothing extra (the mode leaves the stack at the next ``disarm``, where it
is on top; a mode a script pushed above it keeps it there, inert, until it is). A model
whose output holds its own loss (a 0-d tensor that requires grad: nanoGPT's ``(logits,
loss)``, a Hugging Face output's ``loss``) arms nothing: its targets are among its inputs
already. Under ``torch.compile`` tracing nothing is armed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode, _push_mode
from torch.utils.hooks import RemovableHandle

from trainguard.capture import batchtree
from trainguard.step.recorded_batches import RecordedBatches

logger = logging.getLogger(__name__)


def _from(arg: Tensor, outputs: list[Tensor]) -> bool:
    """Whether ``arg`` is one of ``outputs`` or a view of one (``out.view(-1, V)``)."""
    base = arg._base
    for out in outputs:
        if arg is out or (base is not None and (base is out or base is out._base)):
            return True
    return False


def _call_tensors(args: tuple[Any, ...], kwargs: Any) -> list[Tensor]:
    """A torch call's tensors: its arguments and the items of a list or tuple argument
    (``torch.cat([out, y])``). A shallow look: it runs at every call the mode sees."""
    found: list[Tensor] = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, Tensor):
            found.append(value)
        elif type(value) in (list, tuple):
            found += [item for item in value if isinstance(item, Tensor)]
    return found


_FORK_HOOK: list[bool] = []


def _leave_in_forked_children() -> None:
    """Once per process: a child forked while the mode is on the stack (a DataLoader's
    workers, made at an epoch's first batch) takes it off, or every torch call of its
    collation would pass through it."""
    if not _FORK_HOOK:
        _FORK_HOOK.append(True)
        os.register_at_fork(after_in_child=_drop_inherited_mode)


def _drop_inherited_mode() -> None:
    mode = _get_current_function_mode()  # type: ignore[no-untyped-call]
    if isinstance(mode, _LossCalls):
        mode.live = False
        _pop_mode()  # type: ignore[no-untyped-call]


MODULE, FUNCTION = "module", "function"
BOTH = frozenset((MODULE, FUNCTION))
GIVE_UP = 8
"""Armings in a row where neither follower found a loss, after which neither is armed."""
REPROBE_EVERY = 100
"""Then every this many armings both are tried again."""
MAX_CALLS = 64
"""Torch calls followed after the model's output before the function follower gives up (a
loop that computes much else before its loss)."""


class _LossCalls(TorchFunctionMode):
    """Follows the model's output through torch calls to the loss (see the module's text)."""

    def __init__(self, done: Any) -> None:
        super().__init__()
        self.live = False
        self._followed: list[Tensor] = []
        self._extra: list[Tensor] = []
        self._count = 0
        self._done = done

    def start(self, outputs: list[Tensor]) -> None:
        """Follow ``outputs`` (one object for the whole run: the mode on the stack is the same
        at every step, so a compiled function called under it sees no new mode each step)."""
        self._followed = [out for out in outputs if out.requires_grad]
        self._extra, self._count, self.live = [], 0, True

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if self.live:
            try:
                self._seen(func, args, kwargs, result)
            except Exception as exc:  # never into the script's call
                logger.debug("trainguard run: a loss function not read: %s", exc)
                self.live = False
        return result

    def _seen(self, func: Any, args: tuple[Any, ...], kwargs: Any, result: Any) -> None:
        self._count += 1
        tensors = _call_tensors(args, kwargs)
        if not any(_from(t, self._followed) for t in tensors):
            if self._count >= MAX_CALLS:
                self.live = False
            return
        for t in tensors:
            known = any(t is e for e in self._extra)
            if not t.requires_grad and not known and not _from(t, self._followed):
                self._extra.append(t)
        if func is Tensor.backward:
            self._finish()
        elif isinstance(result, Tensor) and result.requires_grad:
            if result.dim() == 0:
                self._finish()  # the loss
            else:
                self._followed.append(result)

    def _finish(self) -> None:
        extra = self._extra
        self.stop()
        self._done(extra)

    def stop(self) -> None:
        """Inert until the next ``start``, holding no tensor (the model's output may be
        large: it is not kept past the step)."""
        self.live = False
        self._extra, self._followed = [], []


class LossInputs:
    """Arms a module pre-hook after the model's training call; the loss call it sees first
    adds its other tensor arguments to the step's micro-batch."""

    def __init__(self) -> None:
        self._handle: RemovableHandle | None = None
        self._mode: _LossCalls | None = None
        """On the torch function stack (inert once ``live`` is False) until it can leave."""
        self._outputs: list[Tensor] = []
        self._recorded: RecordedBatches | None = None
        self._index = -1
        self.follow = BOTH
        """The followers armed: the one that found the loss last time, else both."""
        self.found_by: str | None = None
        """The follower that found this arming's loss (``MODULE`` or ``FUNCTION``)."""
        self._armed = False
        self._missed = 0
        """Armings in a row where both followers found nothing."""
        self._armings = 0
        self._calls: _LossCalls | None = None
        """The function follower, made once (``_mode`` while it is on the stack)."""

    def arm(self, output: Any, recorded: RecordedBatches) -> None:
        """After a training call of the model whose micro-batch ``recorded`` holds last.
        Never raises: at worst the micro-batch stays the model's input."""
        self.disarm()
        try:
            outputs = batchtree.tensors(output)
        except Exception as exc:  # an output the walk cannot take apart
            logger.debug("trainguard run: the model's output not followed: %s", exc)
            return
        if not outputs or not recorded.current:
            return
        if any(out.dim() == 0 and out.requires_grad for out in outputs):
            return  # the loss is the model's own (nanoGPT's, HF's): its targets are its inputs
        self._armings += 1
        follow = self.follow if self.follow or self._armings % REPROBE_EVERY else BOTH
        if not follow:
            return
        self._outputs, self._recorded = outputs, recorded
        self._index = len(recorded.current) - 1
        self._armed, self.found_by = True, None
        if MODULE in follow:
            self._handle = register_module_forward_pre_hook(self._pre)
        grad = any(out.requires_grad for out in outputs)
        armable = FUNCTION in follow and grad and self._mode is None
        if armable and not torch.compiler.is_compiling():
            _leave_in_forked_children()
            if self._calls is None:
                self._calls = _LossCalls(self._found)
            self._calls.start(outputs)
            self._mode = self._calls
            _push_mode(self._mode)  # type: ignore[no-untyped-call]

    def disarm(self) -> None:
        """Stop both followers (outside any torch call: the mode leaves the stack here when
        it is on top)."""
        self._stop()
        if self._armed:
            self._armed = False
            self._learn()
        mode = self._mode
        if mode is not None and _get_current_function_mode() is mode:  # type: ignore[no-untyped-call]
            _pop_mode()  # type: ignore[no-untyped-call]
            self._mode = None

    def _learn(self) -> None:
        """After an arming: the follower that found the loss is the only one armed next
        (the other costs every call until the optimizer step); a miss arms both again;
        after ``GIVE_UP`` misses of both, neither is armed but every ``REPROBE_EVERY``-th
        time (a loop whose loss neither can see)."""
        if self.found_by is not None:
            self.follow, self._missed = frozenset((self.found_by,)), 0
        elif self.follow != BOTH:
            self.follow = BOTH
        else:
            self._missed += 1
            if self._missed >= GIVE_UP:
                self.follow = frozenset()

    def _stop(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
        self._outputs, self._recorded = [], None
        if self._calls is not None:
            self._calls.stop()

    def _found(self, extra: list[Tensor]) -> None:
        """The loss function's own inputs (inside its torch call): they join the micro-batch;
        both followers stop, and the mode leaves the stack at the next ``disarm``."""
        recorded, index = self._recorded, self._index
        self.found_by = FUNCTION
        self._stop()
        if extra and recorded is not None:
            recorded.add_loss_inputs(index, extra)

    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Every module call while armed: never raises into the script's call."""
        try:
            self._seen(args)
        except Exception as exc:
            logger.debug("trainguard run: a loss call not read: %s", exc)
            self.disarm()

    def _seen(self, args: tuple[Any, ...]) -> None:
        outputs, recorded = self._outputs, self._recorded
        if recorded is None:
            return
        tensors = [arg for arg in args if isinstance(arg, Tensor)]
        if not any(_from(arg, outputs) for arg in tensors):
            return  # not the loss (a module applied to the targets first): keep looking
        extra = [arg for arg in tensors if not _from(arg, outputs)]
        index = self._index
        self.found_by = MODULE
        self.disarm()  # the mode too (no torch call is in flight: a module call starts)
        if extra:
            recorded.add_loss_inputs(index, extra)
