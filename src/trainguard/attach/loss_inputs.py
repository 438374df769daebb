"""The targets of ``loss = criterion(model(x), y)`` and ``F.cross_entropy(model(x), y)``,
kept beside the model's input, and the loss itself, for the step's check.

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

The loss found is also the step's loss (``take_losses``, at the check): the loss module's
result (read by a process-wide forward hook when that call ends), the function follower's
0-d result (or the tensor ``backward()`` is called on, if that comes first), or the model's
own 0-d output, detached. Each training call of the model is one entry of its step; a step
whose every call gave one is checked with them (``Guard.record_loss`` each, then
``check()``), any other with its gradients alone (the row's ``loss_unknown`` column then
keeps every rank from reading a loss for that step).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode, _push_mode
from torch.utils.hooks import RemovableHandle

from trainguard.attach.backward_calls import computed_from
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


def _finite_or(loss: Tensor | None, after: Tensor | None) -> Tensor | None:
    """``loss``, or where the tensor a backward ran on (computed from it) is not finite,
    that tensor: on the device, no host read."""
    if loss is None or after is None:
        return loss
    try:
        return torch.where(torch.isfinite(after), loss, after.to(loss.dtype))
    except RuntimeError as exc:  # never into the script's step: the loss as read
        logger.debug("trainguard run: a backward's tensor not compared: %s", exc)
        return loss


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
            self._finish(args[0] if args and isinstance(args[0], Tensor) else None)
        elif isinstance(result, Tensor) and result.requires_grad:
            if result.dim() == 0:
                self._finish(result)  # the loss
            else:
                self._followed.append(result)

    def _finish(self, loss: Tensor | None) -> None:
        extra = self._extra
        self.stop()
        self._done(extra, loss)

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
        self._losses: list[tuple[int, int, Tensor | None]] = []
        """Per training call since the last ``take_losses``: the guard's step it belongs to,
        the ``id`` of the module called and the loss found from its output (detached), None
        while none is."""
        self._node: tuple[int, Any] | None = None
        """The latest loss's entry in ``_losses`` and its autograd node (``grad_fn``), until
        a backward ran or the followers are disarmed (the model's next call, the optimizer
        step): holding the node holds the graph, and a loop that leaves a step out before
        its backward (its own ``if``) would keep that step's activations through the next
        forward."""
        self._after: dict[int, Tensor] = {}
        """Per entry of ``_losses``: the tensor a backward ran on, computed from its loss
        (``backward_calls.py``), detached."""
        self._loss_call: tuple[nn.Module, RemovableHandle] | None = None
        """The loss module's call in flight and the process-wide forward hook that reads its
        result (the module follower sees the call's arguments, before it runs)."""

    def arm(self, output: Any, recorded: RecordedBatches, step: int, module: nn.Module) -> None:
        """After a training call of ``module`` (the model), in the guard's ``step``, whose
        micro-batch ``recorded`` holds last. Never raises: at worst the micro-batch stays the
        model's input and its loss unknown.

        A call whose output needs no gradient is left alone: no loss can come of it, so it
        neither disarms the followers nor counts as a miss. ``PreStart`` arms after every
        top-level call before the guard knows its model, and a data transform that is a
        module (torchvision's ``Normalize``, called per sample in the loader's main-process
        fetch: PyTorch's MNIST example) came 64 times a batch before the model's first call:
        the followers gave up after ``GIVE_UP`` misses and the loss was never seen; a loop
        fetching its next batch between the model's call and the loss disarmed them."""
        call = self._loss_call
        if call is not None and module is call[0]:  # the loss module's own call ending (a
            self._loss_result(module, (), output)  # hook that came first sees it): its result
            return
        try:
            outputs: list[Tensor] | None = batchtree.tensors(output)
        except Exception as exc:  # an output the walk cannot take apart
            logger.debug("trainguard run: the model's output not followed: %s", exc)
            outputs = None
        if outputs is not None and not any(out.requires_grad for out in outputs):
            return  # no gradient, no loss: the followers stay as they are
        self.disarm()
        self._losses.append((step, id(module), None))
        if not outputs or not recorded.current:
            return
        own = [out for out in outputs if out.dim() == 0 and out.requires_grad]
        if own:  # the loss is the model's own (nanoGPT's, HF's): its targets are its inputs
            self._note_loss(own[0])
            return
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

    def take_losses(self, step: int, model: nn.Module) -> list[Tensor] | None:
        """At the guard's check of ``step``: the loss of each training call of ``model`` in
        that step (detached: the micro-batches' losses, in order), or None when some call's
        loss was not found (then the step's loss is unknown, not partly known). Calls of
        earlier steps (a step the loop left out, checked without its losses) and of other
        modules are dropped."""
        calls, self._losses = self._losses, []
        after, self._after, self._node = self._after, {}, None
        losses = [
            _finite_or(loss, after.get(index))
            for index, (at, owner, loss) in enumerate(calls)
            if at == step and owner == id(model)
        ]
        found = [loss for loss in losses if loss is not None]
        return found if found and len(found) == len(losses) else None

    def disarm(self) -> None:
        """Stop both followers (outside any torch call: the mode leaves the stack here when
        it is on top)."""
        self._stop()
        self._forget_loss_call()
        self._node = None
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

    def _found(self, extra: list[Tensor], loss: Tensor | None) -> None:
        """The loss function's own inputs (inside its torch call): they join the micro-batch,
        and its result is the call's loss; both followers stop, and the mode leaves the
        stack at the next ``disarm``."""
        recorded, index = self._recorded, self._index
        self.found_by = FUNCTION
        self._stop()
        if loss is not None:
            self._note_loss(loss)
        if extra and recorded is not None:
            recorded.add_loss_inputs(index, extra)

    def _note_loss(self, loss: Tensor) -> None:
        """The loss of the latest training call: a plain 0-d tensor that needs a gradient (a
        tensor subclass, a DTensor loss of tensor parallelism, is left unknown: the check
        takes plain tensors)."""
        if self._losses and type(loss) is Tensor and loss.dim() == 0 and loss.requires_grad:
            step, owner, _ = self._losses[-1]
            self._losses[-1] = (step, owner, loss.detach())
            self._node = (len(self._losses) - 1, loss.grad_fn)

    def backward_on(self, tensor: Tensor) -> None:
        """A backward runs on ``tensor`` (0-d): kept for the latest training call's loss
        when computed from it and not that loss itself (``backward_calls.py``); the loss's
        node is let go either way (a backward follows its micro-batch's loss)."""
        latest, self._node = self._node, None
        if latest is not None and type(tensor) is Tensor:  # a plain tensor, as losses read
            index, node = latest
            if tensor.grad_fn is not node and computed_from(tensor, node):
                self._after[index] = tensor.detach()

    def release(self) -> None:
        """Let the latest loss's node go (a top-level training call starts: before the
        guard exists, ``PreStart``'s follower is disarmed only when the call ends)."""
        self._node = None

    def _forget_loss_call(self) -> None:
        call, self._loss_call = self._loss_call, None
        if call is not None:
            call[1].remove()

    def _loss_result(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Every module call's end while a loss module's call is in flight: its own end gives
        the loss. Never raises into the script's call."""
        call = self._loss_call
        if call is None or module is not call[0]:
            return  # a module the loss module calls, ending first
        try:
            self._forget_loss_call()
            if isinstance(output, Tensor):
                self._note_loss(output)
        except Exception as exc:  # never into the script's call
            logger.debug("trainguard run: a loss module's result not read: %s", exc)

    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Every module call while armed: never raises into the script's call."""
        try:
            self._seen(module, args)
        except Exception as exc:
            logger.debug("trainguard run: a loss call not read: %s", exc)
            self.disarm()

    def _seen(self, module: nn.Module, args: tuple[Any, ...]) -> None:
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
        handle = register_module_forward_hook(self._loss_result)  # its result: the loss
        self._loss_call = (module, handle)
        if extra:
            recorded.add_loss_inputs(index, extra)
