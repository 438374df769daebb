"""``TrainGuard``: the Guard as a PyTorch Lightning callback (extra ``trainguard[lightning]``).

    trainer = L.Trainer(strategy="ddp", callbacks=[TrainGuard(run_dir="runs/x")])

Where each part of a step happens, in Lightning's own hooks:

- ``on_train_batch_start``: the batch reference (and the RNG state before the step's first
  micro-batch) is kept for the capture (``guard.record_batch``);
- ``on_before_backward``: the micro-batch's loss is kept on the device (no host sync);
- ``on_before_optimizer_step``: the accumulated gradients are reduced (DDP) and unscaled
  (Lightning's precision plugin calls ``scaler.unscale_`` before this hook); ``guard.check``
  runs its one fused pass and one all-reduce. A bad step's gradients are cleared on every
  rank, so the optimizer step that follows changes nothing (and a GradScaler, already past
  ``unscale_``, skips it and lowers its scale). ``on_nonfinite="raise"`` and escalation
  raise the same error on every rank, which ends ``trainer.fit`` everywhere.
- validation runs under ``guard.phase("validation")`` (the hang watchdog does not mistake a
  long evaluation for a hang).

What it refuses at setup (ConfigError): DeepSpeed (the optimizer step runs inside its
backward: there is no point between the gradients and the update) and manual optimization
(call ``Guard.check`` in your ``training_step`` instead).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from trainguard.errors import ConfigError
from trainguard.integrations.options import guard_config, with_accumulation
from trainguard.step.guard import Guard

if TYPE_CHECKING:
    import lightning.pytorch as pl

logger = logging.getLogger(__name__)

try:
    from lightning.pytorch import Callback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "trainguard.integrations.lightning needs lightning: pip install 'trainguard[lightning]'"
    ) from exc

_UNGUARDABLE = {
    "DeepSpeedStrategy": "DeepSpeed steps the optimizer inside backward, so no hook sees the "
    "gradients before the update; use strategy='ddp' or 'fsdp', or DeepSpeed's own overflow "
    "checks",
}


class TrainGuard(Callback):  # type: ignore[misc]
    """A Lightning callback that runs a :class:`trainguard.Guard` on every optimizer step.

    Takes the Guard's options by name (every ``GuardConfig`` field: ``run_dir``,
    ``on_nonfinite``, ``max_consecutive``, ``capture``, ``grad_clip``, ``hang_timeout``...);
    ``accumulation_steps`` comes from ``Trainer(accumulate_grad_batches=...)``.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self._config = guard_config(options, "TrainGuard")
        self.guard: Guard | None = None
        """The Guard of the running fit (from ``on_train_start`` to ``on_train_end``)."""
        self._loss: Tensor | None = None
        self._phases = contextlib.ExitStack()
        self._saved_state: dict[str, Any] | None = None

    # -- setup ------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = type(trainer.strategy).__name__
        if strategy in _UNGUARDABLE:
            raise ConfigError(
                "strategy", f"TrainGuard cannot guard {strategy}: {_UNGUARDABLE[strategy]}"
            )
        if not pl_module.automatic_optimization:
            raise ConfigError(
                "automatic_optimization",
                "TrainGuard guards Lightning's automatic optimization; with manual optimization "
                "build a trainguard.Guard and call guard.check(loss) before opt.step()",
            )
        if self._config.grad_clip is not None and strategy == "FSDPStrategy":
            raise ConfigError(
                "grad_clip",
                "under FSDP use Trainer(gradient_clip_val=...): the flat shards' norm is "
                "Lightning's to reduce",
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ConfigError(
                "configure_optimizers",
                f"TrainGuard guards one optimizer, got {len(trainer.optimizers)}",
            )
        config = with_accumulation(self._config, trainer.accumulate_grad_batches)
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # fp16: a GradScaler
        self.guard = Guard(pl_module, trainer.optimizers[0], scaler=scaler, config=config)
        if self._saved_state is not None:
            self.guard.load_state_dict(self._saved_state)
            self._saved_state = None

    # -- the step ---------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.guard is not None:
            self.guard.record_batch(batch)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor
    ) -> None:
        if self.guard is None:
            return
        if self._loss is not None:  # an earlier micro-batch of this optimizer step
            self.guard.record_loss(self._loss)
        self._loss = _step_loss(loss.detach(), trainer)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        guard = self.guard
        if guard is None:
            return
        loss, self._loss = self._loss, None
        if loss is None:  # no backward this step (training_step returned None on every rank)
            loss = torch.zeros((), device=next(pl_module.parameters()).device)
        guard.check(loss)  # skip: gradients cleared on every rank; raise: on every rank

    # -- phases and the end -----------------------------------------------------------------

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is not None:
            self._phases.enter_context(self.guard.phase("validation"))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phases.close()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            self._close()  # inside Lightning's except block: tells the other ranks' watchdogs
        except Exception:  # never mask the run's own exception
            logger.exception("trainguard: closing the guard after %r failed", exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        self._phases.close()
        guard, self.guard = self.guard, None
        if guard is not None:
            self._saved_state = guard.state_dict()
            guard.close()

    # -- checkpoints: the guard's counters travel with Lightning's checkpoints --------------

    def state_dict(self) -> dict[str, Any]:
        if self.guard is not None:
            return self.guard.state_dict()
        return dict(self._saved_state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._saved_state = dict(state_dict)


def _step_loss(loss: Tensor, trainer: pl.Trainer) -> Tensor:
    """The loss ``training_step`` returned, from the one backward sees: Lightning divides it
    by ``accumulate_grad_batches`` and, under fp16, multiplies it by the GradScaler's scale
    (a device tensor: no host sync). The guard's loss history and spike checks need the
    training_step's value; finiteness is the same either way."""
    scale = getattr(getattr(trainer.precision_plugin, "scaler", None), "_scale", None)
    if isinstance(scale, Tensor):  # GradScaler keeps it on the device (private, stable)
        loss = loss / scale.to(loss.device)
    accumulate = trainer.accumulate_grad_batches
    return loss * accumulate if accumulate != 1 else loss


# -- replay ----------------------------------------------------------------------------------


def training_step_loss(module: nn.Module, batch: Any) -> Tensor:
    """The loss of ``module.training_step(batch, 0)`` (a tensor, or a dict's ``"loss"``).

    ``self.log`` in the step is a no-op here (no Trainer is attached); its warning is muted."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
        out = module.training_step(batch, 0)  # type: ignore[operator]
    if isinstance(out, dict):
        out = out.get("loss")
    if not isinstance(out, Tensor):
        raise TypeError(
            f"training_step returned {type(out).__name__}; replay needs a loss tensor "
            "(or a dict with 'loss')"
        )
    return out


def replay_spec(module: nn.Module) -> tuple[nn.Module, Callable[[nn.Module, Any], Tensor]]:
    """What a ``trainguard replay --factory`` returns for a LightningModule: the module and
    its ``training_step`` as the loss. The factory builds the module as the run did::

        def make_replay():
            return replay_spec(MyModule(hidden=64))
    """
    return module, training_step_loss
