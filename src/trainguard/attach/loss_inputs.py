"""The targets of ``loss = criterion(model(x), y)``, kept beside the model's input.

``trainguard run`` records a step's micro-batch where the model is called: its inputs. The
loss often takes more (the targets, a mask), and a replay without them had to invent them.
So after each training call of the model a process-wide module pre-hook is armed
(``LossInputs.arm``): at the first module call outside the model that is handed the model's
output (the tensor itself, a view of it, or a tensor of a tuple or dict output), the call's
other tensor arguments are the loss's own inputs, and the micro-batch becomes
``(inputs, *loss_inputs)``: what a replay factory's ``loss_fn(model, batch)`` takes apart as
``x, y = batch``. The hook is removed there, or at the model's next call or the optimizer
step (``disarm``): the modules inside the model's forward never see it, and a module call
costs nothing extra the rest of the step. A model whose output holds its own loss (a 0-d
tensor that requires grad: nanoGPT's ``(logits, loss)``, a Hugging Face output's ``loss``)
arms nothing: its targets are among its inputs already. A functional loss
(``F.cross_entropy(out, y)``) calls no module and is not seen: the micro-batch stays the
model's input.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_pre_hook
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


class LossInputs:
    """Arms a module pre-hook after the model's training call; the loss call it sees first
    adds its other tensor arguments to the step's micro-batch."""

    def __init__(self) -> None:
        self._handle: RemovableHandle | None = None
        self._outputs: list[Tensor] = []
        self._recorded: RecordedBatches | None = None
        self._index = -1

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
        self._outputs, self._recorded = outputs, recorded
        self._index = len(recorded.current) - 1
        self._handle = register_module_forward_pre_hook(self._pre)

    def disarm(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
        self._outputs, self._recorded = [], None

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
        self.disarm()
        if extra:
            recorded.add_loss_inputs(index, extra)
