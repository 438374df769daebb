"""The Guard in the Hugging Face Trainer (extra ``trainguard[transformers]``).

    class MyTrainer(TrainGuardMixin, Trainer): ...        # or TrainGuardMixin, SFTTrainer
    trainer = MyTrainer(..., callbacks=[TrainGuardCallback(run_dir="runs/x")])

A ``TrainerCallback`` sees neither the loss nor the batches, and ``on_pre_optimizer_step``
comes after the Trainer's ``max_grad_norm`` clip: a non-finite total norm has by then turned
every gradient into NaN, so the parameters that were bad can no longer be named. Hence the
mixin, on ``training_step`` (the Trainer's documented override point), per micro-batch:

- before it: the batch reference (and the RNG state before the step's first micro-batch) is
  kept for the capture: the bundle holds the whole accumulation window;
- after it: the loss is kept on the device; on the window's last micro-batch (the Trainer's
  ``sync_gradients``: DDP has reduced the gradients in that backward) ``guard.check`` runs its
  one fused pass and one all-reduce, before the clip.

A bad step's gradients are cleared on every rank: the clip then sees none (``grad_norm`` 0
in the logs), ``optimizer.step()`` leaves weights and moments unchanged. The Trainer still
counts the step: ``global_step`` and the LR scheduler advance on a skipped step, exactly as
for a step whose update was zero, so the schedule stays aligned with ``global_step`` and
``max_steps``. ``on_nonfinite="raise"`` and escalation raise on every rank out of
``trainer.train()``.

With a GradScaler on the Trainer's accelerator (``fp16=True`` on a GPU) the window's last
micro-batch records its loss and ``guard.check`` runs at ``on_pre_optimizer_step``, after
the Trainer's clip has unscaled the gradients (``Guard(scaler=...)`` finds them unscaled;
the clip's spread of a NaN then hides which parameters were bad). A bad step is the
scaler's skip: its overflow marked on every rank, the scaler leaves the update out and lowers
its scale, and accelerate holds the LR scheduler, as for an overflow of its own; an overflow
with a finite loss is the scaler's business (an ``overflow`` event, not a bad step). Before,
the check ran before the clip and a skip cleared the gradients, and the scaler, finding
none to check, raised at ``optimizer.step()`` ("No inf checks were recorded").

Evaluation runs under ``guard.phase("evaluation")``, a checkpoint's write under
``guard.phase("checkpoint")``.

A Trainer without ``TrainGuardMixin`` is refused in ``on_train_begin``, before any forward.
``log_metrics=True`` (the default): the mixin's ``log()`` adds ``guard.metrics()`` to the
Trainer's training logs before its callbacks see them, so the reporting integrations
(``report_to``: W&B, TensorBoard, MLflow...), which the Trainer puts before the user's
callbacks, receive ``trainguard/skipped_steps`` and the rest.

``TrainGuardCallback(rerun=True)``: an agreed bad step is rerun in place before the decision
(``Guard(rerun=...)``), through the Trainer's own ``training_step`` (the user's override and
``compute_loss`` included) on the model the loop passed (``model_wrapped``: DDP's forward and
all-reduce), in ``accelerator.no_sync`` for every micro-batch but the window's last, as the
Trainer's loop runs them (``integrations/transformers_rerun.py``). Refused at setup with a
ConfigError: fp16 (a GradScaler), FSDP, and a Trainer without ``TrainGuardMixin``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trainguard.errors import ConfigError
from trainguard.integrations.options import guard_config, pop_log_metrics, with_accumulation
from trainguard.integrations.rerun import StepMicroBatches, pop_rerun
from trainguard.integrations.transformers_rerun import TrainerRerun, check_rerun
from trainguard.step.guard import Guard

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "trainguard.integrations.transformers needs transformers: "
        "pip install 'trainguard[transformers]'"
    ) from exc

logger = logging.getLogger(__name__)

GUARD_STATE = "trainguard_state.pt"
"""The guard's ``state_dict()`` in a Trainer checkpoint folder (``on_save``)."""


class TrainGuardCallback(TrainerCallback):  # type: ignore[misc]
    """Runs a :class:`trainguard.Guard` in a Trainer that has :class:`TrainGuardMixin`.

    Takes the Guard's options by name (every ``GuardConfig`` field); ``accumulation_steps``
    comes from ``TrainingArguments.gradient_accumulation_steps``. ``rerun=True``: rerun a bad
    step's ``training_step`` in place before deciding (module docstring, docs/transformers.md).
    ``log_metrics=False``: keep ``guard.metrics()`` out of the Trainer's logs.
    """

    def __init__(self, **options: Any) -> None:
        options = dict(options)
        self._rerun = pop_rerun(options, "TrainGuardCallback")
        self._log_metrics = pop_log_metrics(options, "TrainGuardCallback")
        self._config = guard_config(options, "TrainGuardCallback")
        self._micro = StepMicroBatches()
        self._trainer: Any = None  # bound by TrainGuardMixin.train()
        self.guard: Guard | None = None
        """The Guard of the running ``train()``."""
        self.final_state: dict[str, Any] | None = None
        """The guard's ``state_dict()`` when training ended."""
        self._checked = False
        self._due = False
        """A step's last micro-batch came and its check waits: the guard has the Trainer's
        GradScaler (fp16 on a GPU), so it checks at ``on_pre_optimizer_step``, after the
        Trainer's clip has unscaled the gradients."""
        self._resume_from: str | None = None
        """The Trainer checkpoint ``train(resume_from_checkpoint=...)`` resumes from."""

    # -- TrainerCallback hooks ----------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "deepspeed", None):
            raise ConfigError(
                "deepspeed",
                "TrainGuardCallback cannot guard DeepSpeed: it steps the optimizer inside "
                "backward, so no hook sees the gradients before the update",
            )
        if self._rerun:  # its own message: the rerun calls the mixin's training_step
            check_rerun(args, self._trainer)
        if not isinstance(self._trainer, TrainGuardMixin):  # bound by the mixin's train()
            raise ConfigError(
                "trainer",
                "TrainGuardCallback needs the Trainer to have TrainGuardMixin (class "
                "MyTrainer(TrainGuardMixin, Trainer)): a callback sees neither the loss nor "
                "the batches; refused before the first step",
            )
        scaler = getattr(getattr(self._trainer, "accelerator", None), "scaler", None)
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if not isinstance(model, nn.Module) or optimizer is None:
            raise ConfigError("model", "the Trainer passed no model/optimizer to on_train_begin")
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        config = with_accumulation(self._config, args.gradient_accumulation_steps)
        if getattr(state, "global_step", 0) > 0 and config.run is None:  # resume_from_checkpoint
            config = dataclasses.replace(config, run="continue")  # the same run goes on
        rerun = None
        if self._rerun:
            check_rerun(args, self._trainer)
            rerun = TrainerRerun(self._trainer, self._micro)
        self.guard = Guard(model, inner, config=config, rerun=rerun, scaler=scaler)
        self.guard.internals.name_loss_source(custom_loss(self._trainer))
        if self._resume_from is not None:
            self._load_guard_state(Path(self._resume_from), getattr(state, "global_step", 0))

    def _load_guard_state(self, checkpoint: Path, global_step: int) -> None:
        """The guard's counters as the Trainer checkpoint saved them (``on_save``), so the
        resumed run names the Trainer's steps and keeps counting its bad steps."""
        guard = self.guard
        saved = checkpoint / GUARD_STATE
        if guard is None:
            return
        if not saved.is_file():
            logger.warning(
                "trainguard: %s holds no %s (saved without TrainGuardCallback): the guard's "
                "counters start afresh at step 0 while the Trainer resumes at step %d",
                checkpoint,
                GUARD_STATE,
                global_step,
            )
            return
        guard.load_state_dict(torch.load(saved, weights_only=False))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Save the guard's ``state_dict()`` into the checkpoint the Trainer just wrote (the
        first process: the state is the same on every rank; no collective)."""
        guard = self.guard
        if guard is None or not getattr(state, "is_world_process_zero", True):
            return
        trainer = self._trainer
        root = trainer._get_output_dir(trial=None) if trainer is not None else args.output_dir
        folder = Path(root) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            torch.save(guard.state_dict(), folder / GUARD_STATE)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is not None and self._due:  # a GradScaler's step: after its unscale
            self._due = False
            self._check(None)
        if self.guard is not None and not self._checked:
            raise ConfigError(
                "trainer",
                "TrainGuardCallback needs the Trainer to have TrainGuardMixin (class "
                "MyTrainer(TrainGuardMixin, Trainer)): a callback sees neither the loss nor "
                "the batches",
            )
        self._checked = False

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    # -- called by TrainGuardMixin ----------------------------------------------------------

    def bind(self, trainer: Any, resume_from: str | None = None) -> None:
        """The Trainer this callback guards and the checkpoint its ``train()`` resumes from
        (``TrainGuardMixin.train`` calls it)."""
        self._trainer = trainer
        self._resume_from = resume_from

    def add_metrics(self, logs: dict[str, Any]) -> None:
        """Add ``guard.metrics()`` to a training log of the Trainer (one with ``loss``, or the
        final ``train_loss``); evaluation logs are left alone. Host numbers, no sync."""
        guard = self.guard
        if guard is None or not self._log_metrics:
            return
        if "loss" not in logs and "train_loss" not in logs:
            return
        for key, value in guard.metrics().items():
            logs.setdefault(key, value)

    @property
    def rerunning(self) -> bool:
        """True while a bad step is rerun (the mixin then hands nothing to the guard)."""
        return self._micro.active

    def before_micro_batch(self, inputs: Any) -> None:
        if self.guard is not None:
            self.guard.record_batch(inputs)

    def rerun_arguments(self, inputs: Any, model: nn.Module, num_items_in_batch: Any) -> None:
        """With ``rerun=True``: what the loop passed this micro-batch's ``training_step``
        (``model`` is the wrapped one), to rerun it the same way."""
        if self.guard is not None and self._rerun:
            self._micro.record(self.guard.state.step, inputs, (model, num_items_in_batch))

    def after_micro_batch(self, loss: Tensor, last_of_step: bool, window: int = 1) -> None:
        """Keep the loss; on the window's last micro-batch check the step (every rank).
        ``window``: the Trainer's ``current_gradient_accumulation_steps``; its
        ``training_step`` returns each micro-batch's share of the window's loss (divided by
        the window, or normalised by the window's item count), so the share times the window
        is the micro-batch's loss, whose mean over the window is the loss the Trainer logs."""
        guard = self.guard
        if guard is None:
            return
        if window > 1:
            loss = loss * window
        if not last_of_step:
            guard.record_loss(loss)
            return
        self._checked = True
        if guard.scaler is not None:  # checked at on_pre_optimizer_step (``_due``)
            guard.record_loss(loss)
            self._due = True
            return
        self._check(loss)

    def _check(self, loss: Tensor | None) -> None:
        """The step's check (skip: gradients cleared on every rank; raise: on every rank)."""
        guard = self.guard
        if guard is None:
            return
        try:
            guard.check(loss)
        except BaseException:
            self._log_final_metrics()  # the step that ends the run reaches the reporters too
            raise

    def _log_final_metrics(self) -> None:
        """``guard.metrics()`` of a step whose check raised (an escalation stops the run),
        through the Trainer's ``log`` (its reporters' ``on_log``, ``state.log_history``);
        never masks the exception being raised."""
        guard, trainer = self.guard, self._trainer
        if guard is None or trainer is None or not self._log_metrics:
            return
        try:
            trainer.log(dict(guard.metrics()))
        except Exception:
            logger.exception("trainguard: logging the metrics of the step that ended the run")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.guard is None:
            yield
            return
        with self.guard.phase(name):
            yield

    def close(self) -> None:
        self._trainer = None
        guard, self.guard = self.guard, None
        if guard is not None:
            self.final_state = guard.state_dict()
            guard.close()


class TrainGuardMixin:
    """Put it before ``Trainer`` (or any Trainer subclass) in the bases: hands each micro-
    batch and its loss to the ``TrainGuardCallback`` in ``callbacks``."""

    def _trainguard(self) -> TrainGuardCallback:
        found = self._trainguard_or_none()
        if found is None:
            raise ConfigError(
                "callbacks", "TrainGuardMixin needs a TrainGuardCallback(...) in callbacks"
            )
        return found

    def _trainguard_or_none(self) -> TrainGuardCallback | None:
        handler = getattr(self, "callback_handler", None)
        callbacks = getattr(handler, "callbacks", [])
        return next((c for c in callbacks if isinstance(c, TrainGuardCallback)), None)

    def training_step(
        self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None
    ) -> Tensor:
        guard = self._trainguard()
        if guard.rerunning:  # the guard reruns a bad step: the Trainer's own step, unrecorded
            rerun: Tensor = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
            return rerun
        guard.before_micro_batch(inputs)
        guard.rerun_arguments(inputs, model, num_items_in_batch)
        loss: Tensor = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        accelerator = getattr(self, "accelerator", None)
        last_of_step = bool(getattr(accelerator, "sync_gradients", True))
        window = int(getattr(self, "current_gradient_accumulation_steps", 1) or 1)
        guard.after_micro_batch(loss, last_of_step, window)
        return loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``, with ``guard.metrics()`` added to its training logs first:
        every callback's ``on_log`` (the reporters come before the user's callbacks) sees
        them, and so does ``state.log_history``."""
        handler = getattr(self, "callback_handler", None)
        for callback in getattr(handler, "callbacks", []):
            if isinstance(callback, TrainGuardCallback):
                callback.add_metrics(logs)
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def train(self, *args: Any, **kwargs: Any) -> Any:
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if resume is True:  # the Trainer's own rule: the last checkpoint in output_dir
            from transformers.trainer_utils import get_last_checkpoint

            resume = get_last_checkpoint(self.args.output_dir)  # type: ignore[attr-defined,no-untyped-call]
        callback = self._trainguard()
        callback.bind(self, str(resume) if isinstance(resume, (str, Path)) else None)
        try:
            return super().train(*args, **kwargs)  # type: ignore[misc]
        except BaseException as exc:
            try:  # on_train_end never comes: close here (the close event names the error)
                callback.close()
            except Exception:  # never mask the run's own exception
                logger.exception("trainguard: closing the guard after %r failed", exc)
            raise

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's checkpoint write (the process that saves: weights through
        safetensors, optimizer and scheduler through ``torch.save``), as a phase of the
        guard: while it writes, the other ranks wait in the next step's collective, which the
        watchdog does not take for a hang, however large the checkpoint."""
        callback = self._trainguard_or_none()
        if callback is None:
            return super()._save_checkpoint(*args, **kwargs)  # type: ignore[misc]
        with callback.phase("checkpoint"):
            return super()._save_checkpoint(*args, **kwargs)  # type: ignore[misc]

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``evaluate``, as a phase of the guard (the watchdog does not take it
        for a hang); without a ``TrainGuardCallback`` (an evaluation-only script reusing the
        training Trainer class) the plain one: there is no training to guard."""
        callback = self._trainguard_or_none()
        if callback is None:
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]
        with callback.phase("evaluation"):
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]


# -- rerun -----------------------------------------------------------------------------------


def custom_loss(trainer: Any) -> str | None:
    """The Trainer's own loss computation, when it is not the model's: a subclass's
    ``compute_loss`` override or a ``compute_loss_func`` (what ``replay_spec``'s
    ``model_loss`` does not compute); None for the stock one."""
    from transformers import Trainer

    func = getattr(trainer, "compute_loss_func", None)
    if func is not None:
        return f"compute_loss_func ({getattr(func, '__qualname__', type(func).__name__)})"
    override = next((cls for cls in type(trainer).__mro__ if "compute_loss" in vars(cls)), Trainer)
    if override is Trainer or issubclass(Trainer, override):
        return None
    return f"{override.__qualname__}.compute_loss"


# -- replay ----------------------------------------------------------------------------------


def model_loss(model: nn.Module, batch: Any) -> Tensor:
    """The loss of an HF model on a Trainer batch (a dict with ``labels``).

    When the model has a ``loss_function`` (causal LM, ...) the logits come from the model and
    the loss is computed outside it, with the model's own loss function (mean over the
    labelled tokens), so replay tells a bad loss from a bad forward; otherwise ``outputs.loss``.
    """
    labels = batch.get("labels") if isinstance(batch, dict) else None
    loss_function = getattr(model, "loss_function", None)
    if labels is None or not callable(loss_function):
        out = model(**batch)
        return out["loss"] if isinstance(out, dict) else out[0]  # type: ignore[no-any-return]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    vocab_size = model.config.vocab_size  # type: ignore[union-attr]
    loss: Tensor = loss_function(logits=logits, labels=labels, vocab_size=vocab_size)
    return loss


def replay_spec(model: nn.Module) -> tuple[nn.Module, Callable[[nn.Module, Any], Tensor]]:
    """What a ``trainguard replay --factory`` returns for an HF model: the model built from
    the run's config (its weights come from the bundle) and ``model_loss``::

        def make_replay():
            return replay_spec(GPT2LMHeadModel(GPT2Config(n_layer=2, ...)))
    """
    return model, model_loss
