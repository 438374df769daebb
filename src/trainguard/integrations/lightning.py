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
- validation runs under ``guard.phase("validation")``, and ``trainer.save_checkpoint`` under
  ``guard.phase("checkpoint")`` (the hang watchdog does not mistake a long evaluation or a
  large checkpoint for a hang).

``log_metrics=True`` (the default): after each check, ``guard.metrics()`` goes to the
Trainer's loggers (``logger.log_metrics``, rank 0, at ``log_every_n_steps`` and at once after
a step that was not applied), as host numbers: no tensor is made, no sync, no collective.

What it refuses at setup (ConfigError): DeepSpeed (the optimizer step runs inside its
backward: there is no point between the gradients and the update) and manual optimization
(call ``Guard.check`` in your ``training_step`` instead).

``TrainGuard(rerun=True)``: an agreed bad step is rerun in place before the decision
(``Guard(rerun=...)``), through Lightning's own path: ``strategy.training_step`` (the DDP
wrapper's forward, the precision plugin's autocast) and ``strategy.backward`` (the module's
``backward`` and its hooks), in ``strategy.block_backward_sync()`` for every micro-batch but
the step's last, as Lightning's loop runs them (``integrations/rerun.py``). Refused at setup
with a ConfigError: a GradScaler (``precision="16-mixed"``), a ``training_step`` that takes a
``dataloader_iter``, strategies other than single-device, DDP and ``ModelParallelStrategy``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from trainguard.errors import ConfigError
from trainguard.integrations.options import guard_config, pop_log_metrics, with_accumulation
from trainguard.integrations.rerun import StepMicroBatches, backpropagated, pop_rerun
from trainguard.step.guard import Guard

if TYPE_CHECKING:
    import lightning.pytorch as pl

logger = logging.getLogger(__name__)

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "trainguard.integrations.lightning needs lightning: pip install 'trainguard[lightning]'"
    ) from exc

_UNGUARDABLE = {
    "DeepSpeedStrategy": "DeepSpeed steps the optimizer inside backward, so no hook sees the "
    "gradients before the update; use strategy='ddp' or 'fsdp', or DeepSpeed's own overflow "
    "checks",
}

_RERUN_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy", "ModelParallelStrategy")
"""Where ``rerun=True`` is supported (and tested): the strategy's ``model`` is the
LightningModule or its DistributedDataParallel wrapper (FSDP2 shards in place under
ModelParallelStrategy). The exact classes: XLA's strategies derive from these."""


def _checkpoint_phase(trainer: pl.Trainer, guard: Guard) -> Callable[[], None]:
    """``trainer.save_checkpoint`` (``ModelCheckpoint``'s and the script's) under
    ``guard.phase("checkpoint")``: every rank enters it, rank 0 writes (Lightning serializes
    with ``torch.save``, then writes the bytes through fsspec, which the guard's
    ``torch.save`` marking does not cover) while the others wait in its barrier; the
    watchdog does not take a large checkpoint for a hang. Returns what puts it back."""
    original = trainer.save_checkpoint

    @functools.wraps(original)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        with guard.phase("checkpoint"):
            return original(*args, **kwargs)

    trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]

    def restore() -> None:
        if vars(trainer).get("save_checkpoint") is save_checkpoint:
            del trainer.save_checkpoint

    return restore


class TrainGuard(Callback):  # type: ignore[misc]
    """A Lightning callback that runs a :class:`trainguard.Guard` on every optimizer step.

    Takes the Guard's options by name (every ``GuardConfig`` field: ``run_dir``,
    ``on_nonfinite``, ``max_consecutive``, ``capture``, ``grad_clip``, ``hang_timeout``...);
    ``accumulation_steps`` comes from ``Trainer(accumulate_grad_batches=...)``.
    ``rerun=True``: rerun a bad step's ``training_step`` in place before deciding (see the
    module's docstring and docs/lightning.md). ``log_metrics=False``: keep ``guard.metrics()``
    out of the Trainer's loggers.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__()
        options = dict(options)
        self._rerun = pop_rerun(options, "TrainGuard")
        self._log_metrics = pop_log_metrics(options, "TrainGuard")
        self._config = guard_config(options, "TrainGuard")
        self._micro = StepMicroBatches()
        self.guard: Guard | None = None
        """The Guard of the running fit (from ``on_train_start`` to ``on_train_end``)."""
        self._loss: Tensor | None = None
        self._phases = contextlib.ExitStack()
        self._unmark_saves: Callable[[], None] | None = None
        """Puts the Trainer's own ``save_checkpoint`` back (``_checkpoint_phase``)."""
        self._loaded_state: dict[str, Any] | None = None
        """The guard's state restored from a checkpoint (``fit(ckpt_path=...)``): the next
        fit's guard starts from it."""
        self._final_state: dict[str, Any] | None = None
        """The last fit's closed guard's state (``state_dict()`` after the fit); never
        carried into another fit."""

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
                "build a trainguard.Guard and call guard.check(loss) before opt.step()"
                + (" (TrainGuard(rerun=True): Guard(rerun=loss_fn) there)" if self._rerun else ""),
            )
        if self._config.grad_clip is not None and strategy == "FSDPStrategy":
            raise ConfigError(
                "grad_clip",
                "under FSDP use Trainer(gradient_clip_val=...): the flat shards' norm is "
                "Lightning's to reduce",
            )
        if self._rerun:
            _check_rerun(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ConfigError(
                "configure_optimizers",
                f"TrainGuard guards one optimizer, got {len(trainer.optimizers)}",
            )
        config = with_accumulation(self._config, trainer.accumulate_grad_batches)
        loaded, self._loaded_state, self._final_state = self._loaded_state, None, None
        if loaded is not None and config.run is None:  # fit(ckpt_path=...)
            config = dataclasses.replace(config, run="continue")  # the same run goes on
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # fp16: a GradScaler
        rerun = LightningRerun(trainer, self._micro) if self._rerun else None
        self.guard = Guard(
            pl_module, trainer.optimizers[0], scaler=scaler, config=config, rerun=rerun
        )
        self._unmark_saves = _checkpoint_phase(trainer, self.guard)
        if loaded is not None:
            self.guard.load_state_dict(loaded)
        elif trainer.global_step > 0:  # resumed from a checkpoint saved without TrainGuard
            logger.warning(
                "trainguard: the fit resumes at step %d from a checkpoint without TrainGuard's "
                "state: the guard's counters start afresh, its steps counted from %d as "
                "Lightning's",
                trainer.global_step,
                trainer.global_step,
            )
            self.guard.state.step = trainer.global_step

    # -- the step ---------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.guard is not None:
            self.guard.record_batch(batch)
            if self._rerun:
                self._micro.record(self.guard.state.step, batch, batch_idx)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor
    ) -> None:
        if self.guard is None or self._micro.active:  # the rerun's backward: not a new one
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
        try:  # skip: gradients cleared on every rank; raise: on every rank
            if loss is None:  # no backward this step (training_step returned None everywhere)
                applied = guard.check_gradients(backward_ran=False)  # the loss is unknown
            else:
                applied = guard.check(loss)
        except BaseException:
            if self._log_metrics:  # the step that ends the run reaches the loggers too
                _log_final_metrics(trainer, guard)
            raise
        if self._log_metrics:
            _log_guard_metrics(trainer, guard, applied)

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
        unmark, self._unmark_saves = self._unmark_saves, None
        if unmark is not None:
            unmark()
        guard, self.guard = self.guard, None
        if guard is not None:
            self._final_state = guard.state_dict()
            guard.close()

    # -- checkpoints: the guard's counters travel with Lightning's checkpoints --------------

    def state_dict(self) -> dict[str, Any]:
        if self.guard is not None:
            return self.guard.state_dict()
        return dict(self._final_state or self._loaded_state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._loaded_state = dict(state_dict)


def _log_guard_metrics(trainer: pl.Trainer, guard: Guard, applied: bool) -> None:
    """``guard.metrics()`` to the Trainer's loggers at the optimizer step being taken
    (``trainer.global_step``, the step Lightning logs its own step metrics at), every
    ``log_every_n_steps`` steps as Lightning logs, and at once after a step that was not
    applied. Rank 0 only (the values are the same on every rank). Straight to
    ``logger.log_metrics``: ``self.log`` would make a device tensor of each number (a
    host-to-device copy, a sync on a GPU) to aggregate values that need none."""
    every = int(getattr(trainer, "log_every_n_steps", 50))  # set by the logger connector
    if every <= 0 or not trainer.loggers or not trainer.is_global_zero:
        return
    step = trainer.global_step
    if applied and (step + 1) % every != 0:
        return
    metrics = guard.metrics()
    for logger_ in trainer.loggers:
        logger_.log_metrics(metrics, step=step)


def _log_final_metrics(trainer: pl.Trainer, guard: Guard) -> None:
    """``guard.metrics()`` of a step whose check raised (an escalation stops the run), to
    the loggers at once; never masks the exception being raised."""
    try:
        _log_guard_metrics(trainer, guard, applied=False)
        if trainer.is_global_zero:  # where they were logged (a custom logger saves anywhere)
            for logger_ in trainer.loggers:
                logger_.save()
    except Exception:
        logger.exception("trainguard: logging the metrics of the step that ended the run")


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


# -- rerun ---------------------------------------------------------------------------------


def _check_rerun(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """``rerun=True`` where Lightning cannot rerun the step as it ran it: a ConfigError."""
    strategy = type(trainer.strategy).__name__
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        raise ConfigError(
            "rerun",
            "TrainGuard(rerun=True) cannot rerun under a GradScaler (precision='16-mixed'): "
            "an fp16 overflow is the scaler's to handle; use precision='bf16-mixed' or "
            "'32-true', or TrainGuard(rerun=False)",
        )
    if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        raise ConfigError(
            "rerun",
            "TrainGuard(rerun=True) cannot rerun a training_step that takes a dataloader_iter "
            "(it fetches its own batches: there is none to run again); take (batch, "
            "batch_idx), or TrainGuard(rerun=False)",
        )
    if strategy not in _RERUN_STRATEGIES:
        raise ConfigError(
            "rerun",
            f"TrainGuard(rerun=True) is not supported under {strategy}; use one of "
            f"{', '.join(_RERUN_STRATEGIES)} (strategy='ddp', 'ddp_spawn', a single device), "
            "or TrainGuard(rerun=False)",
        )


class LightningRerun:
    """``loss_fn`` for ``Guard(rerun=...)``: one micro-batch through Lightning's own step.

    ``strategy.training_step`` (through the DDP wrapper's forward, under the precision
    plugin's context), the loss normalised by ``accumulate_grad_batches`` as Lightning's
    closure does, ``strategy.backward`` (the module's ``backward`` and the backward hooks), in
    ``strategy.block_backward_sync()`` for every micro-batch but the step's last. ``self.log``
    is muted meanwhile: the step's logged metrics stay the first pass's (a second ``log`` of
    the same key in one step would count an epoch-aggregated metric twice)."""

    runs_own_autocast = True
    """The step enters the framework's precision context itself (``StepRerun`` adds none)."""

    def __init__(self, trainer: pl.Trainer, micro: StepMicroBatches) -> None:
        self._trainer = trainer
        self._micro = micro

    def __call__(self, module: nn.Module, batch: Any) -> Tensor:
        item, last = self._micro.find(batch)
        trainer = self._trainer
        strategy = trainer.strategy
        pl_module = trainer.lightning_module
        args = (batch, item.info) if _takes_batch_idx(pl_module) else (batch,)
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._micro.rerunning())
            stack.enter_context(_muted_log(pl_module))
            stack.enter_context(torch.enable_grad())
            if not last:
                stack.enter_context(_blocked_sync(strategy))
            loss = _closure_loss(strategy.training_step(*args))
            if loss is None:  # training_step skipped the batch (one process only)
                return torch.zeros((), device=pl_module.device, requires_grad=True)
            strategy.backward(loss / trainer.accumulate_grad_batches, trainer.optimizers[0])
        return backpropagated(loss)


def _takes_batch_idx(pl_module: pl.LightningModule) -> bool:
    """Whether Lightning passes ``batch_idx`` to this ``training_step`` (its own rule)."""
    return bool(is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2))


def _closure_loss(output: Any) -> Tensor | None:
    """The loss of a ``training_step`` output, as Lightning's closure reads it."""
    if isinstance(output, dict):
        output = output.get("loss")
    if output is None or isinstance(output, Tensor):
        return output
    raise TypeError(f"training_step returned {type(output).__name__}, not a loss tensor")


def _blocked_sync(strategy: Any) -> contextlib.AbstractContextManager[Any]:
    """Lightning's own no-sync for accumulating micro-batches (DDP's ``no_sync``)."""
    block = getattr(strategy, "block_backward_sync", None)
    if not callable(block):
        return contextlib.nullcontext()
    context: contextlib.AbstractContextManager[Any] = block()
    return context


@contextlib.contextmanager
def _muted_log(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` (and ``log_dict``, which calls it) do nothing inside the block."""

    def no_log(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.__dict__["log"] = no_log  # an instance attribute shadows the method
    try:
        yield
    finally:
        pl_module.__dict__.pop("log", None)


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
