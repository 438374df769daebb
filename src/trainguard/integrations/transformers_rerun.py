"""``TrainGuardCallback(rerun=True)``: a bad step's micro-batches rerun through the Trainer's
own ``training_step`` (``TrainerRerun``, the ``loss_fn`` of ``Guard(rerun=...)``), and the
settings where that cannot rerun the step as it ran (``check_rerun``)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from trainguard.errors import ConfigError
from trainguard.integrations.rerun import StepMicroBatches, backpropagated


def check_rerun(args: Any, trainer: Any) -> None:
    """``rerun=True`` where the Trainer cannot rerun the step as it ran it: a ConfigError."""
    if trainer is None:
        raise ConfigError(
            "rerun",
            "TrainGuardCallback(rerun=True) needs the Trainer to have TrainGuardMixin (class "
            "MyTrainer(TrainGuardMixin, Trainer)): the rerun calls its training_step",
        )
    if getattr(args, "fp16", False) or getattr(trainer.accelerator, "scaler", None) is not None:
        raise ConfigError(
            "rerun",
            "TrainGuardCallback(rerun=True) cannot rerun under fp16 with a GradScaler "
            "(TrainingArguments(fp16=True)): an fp16 overflow is the scaler's to handle; use "
            "bf16=True, or TrainGuardCallback(rerun=False)",
        )
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(args, "fsdp", None):
        raise ConfigError(
            "rerun",
            "TrainGuardCallback(rerun=True) is not supported under FSDP "
            "(TrainingArguments(fsdp=...)): the Trainer's gradient reduction there is not the "
            "DDP wrapper's; use DDP, or TrainGuardCallback(rerun=False)",
        )


class TrainerRerun:
    """``loss_fn`` for ``Guard(rerun=...)``: one micro-batch through the Trainer's own step.

    ``trainer.training_step(model, inputs, num_items_in_batch)`` with what the loop passed
    (``model`` is ``model_wrapped``: DDP's forward and all-reduce): the user's overrides,
    ``compute_loss``, the Trainer's loss scaling and ``accelerator.backward``; in
    ``accelerator.no_sync(model)`` for every micro-batch but the window's last, unless the
    accelerator syncs each batch (``sync_each_batch``), as the Trainer's loop does."""

    runs_own_autocast = True
    """The step enters the framework's precision context itself (``StepRerun`` adds none)."""

    def __init__(self, trainer: Any, micro: StepMicroBatches) -> None:
        self._trainer = trainer
        self._micro = micro

    def __call__(self, model: nn.Module, batch: Any) -> Tensor:
        item, last = self._micro.find(batch)
        wrapped, num_items_in_batch = item.info
        trainer = self._trainer
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._micro.rerunning())
            stack.enter_context(torch.enable_grad())
            if not last and not _syncs_each_batch(trainer):
                stack.enter_context(trainer.accelerator.no_sync(model=wrapped))
            loss: Tensor = trainer.training_step(wrapped, batch, num_items_in_batch)
        window = int(getattr(trainer, "current_gradient_accumulation_steps", 1) or 1)
        return backpropagated(loss * window if window > 1 else loss)  # as after_micro_batch


def _syncs_each_batch(trainer: Any) -> bool:
    """Whether the accelerator reduces the gradients of every micro-batch."""
    state = getattr(trainer.accelerator, "gradient_state", None)
    kwargs = getattr(state, "plugin_kwargs", None) or {}
    return bool(kwargs.get("sync_each_batch", False))
