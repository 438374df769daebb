"""``TrainGuard(rerun=True)`` in one process (the 2-rank DDP and FSDP2 runs are in
tests/distributed/test_lightning_rerun.py): a one-off NaN is rerun through Lightning's own
step and costs nothing, ``self.log`` stays the first pass's, and what Lightning cannot rerun
is refused at setup."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

L = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import trainguard as tg  # noqa: E402
from trainguard.errors import ConfigError  # noqa: E402
from trainguard.integrations.lightning import TrainGuard, _check_rerun  # noqa: E402

FAULT_STEP = 2


class Net(L.LightningModule):  # type: ignore[misc,name-defined]
    """BatchNorm and dropout; counts its training_step calls and its ``self.log`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1)
        )
        self.steps = 0
        self.logged = 0

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.steps += 1
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def log(self, *args: Any, **kwargs: Any) -> None:
        self.logged += 1
        super().log(*args, **kwargs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _loader() -> DataLoader[tuple[Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 4, generator=gen), torch.randn(48, generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=4)  # 12 batches, 6 steps of 2


def _trainer(callback: TrainGuard, **kwargs: Any) -> Any:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=2,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return L.Trainer(**options)


def _fit(run_dir: Path, fault: bool, precision: str = "32-true") -> tuple[Net, TrainGuard]:
    L.seed_everything(0, verbose=False)
    model = Net()
    callback = TrainGuard(run_dir=run_dir, hang_timeout=0, capture=False, rerun=True)
    poisoned = {"done": not fault}

    def poison(module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        guard = callback.guard
        if poisoned["done"] or guard is None or guard.state.step != FAULT_STEP:
            return None
        poisoned["done"] = True
        return output * float("nan")

    model.net[0].register_forward_hook(poison)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(callback, precision=precision).fit(model, _loader())
    return model, callback


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_one_off_nan_is_rerun_through_training_step_and_costs_nothing(
    tmp_path: Path, precision: str
) -> None:
    """bf16-mixed too: the rerun runs Lightning's step under Lightning's own precision
    context (``LightningRerun.runs_own_autocast``) and ends bit-identical."""
    clean, _ = _fit(tmp_path / "clean", fault=False, precision=precision)
    model, callback = _fit(tmp_path / "fault", fault=True, precision=precision)
    events = tg.read_events(tmp_path / "fault", 0)
    reruns = [(e["step"], e["verdict"]) for e in events if e["kind"] == "rerun"]
    assert reruns == [(FAULT_STEP, "transient")]
    assert not [e for e in events if e["kind"] == "skip"]
    state = callback.state_dict()["state"]
    assert state["step"] == 6 and state["total_nonfinite"] == 0
    want = clean.state_dict()
    for key, value in model.state_dict().items():  # weights and BatchNorm statistics
        assert torch.equal(value, want[key]), key
    assert model.steps == clean.steps + 2  # both micro-batches of the step ran again
    assert model.logged == clean.logged  # ... with self.log muted: the first pass's metrics


def test_a_grad_scaler_is_refused_at_setup(tmp_path: Path) -> None:
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    trainer = _trainer(TrainGuard(run_dir=tmp_path, hang_timeout=0, rerun=True), plugins=[plugin])
    with pytest.raises(ConfigError, match=r"rerun.*GradScaler.*bf16-mixed"):
        trainer.fit(Net(), _loader())


@pytest.mark.filterwarnings("ignore:You are using the `dataloader_iter`")
def test_a_dataloader_iter_training_step_is_refused_at_setup(tmp_path: Path) -> None:
    class IterNet(Net):
        def training_step(self, dataloader_iter: Any) -> Tensor:  # type: ignore[override]
            x, y = next(dataloader_iter)[0]
            return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    trainer = _trainer(TrainGuard(run_dir=tmp_path, hang_timeout=0, rerun=True))
    with pytest.raises(ConfigError, match=r"rerun.*dataloader_iter"):
        trainer.fit(IterNet(), _loader())


def test_other_strategies_and_options_are_refused() -> None:
    class XLAStrategy:  # a stand-in: Lightning's XLA strategies need a TPU
        pass

    trainer = SimpleNamespace(strategy=XLAStrategy(), precision_plugin=SimpleNamespace())
    with pytest.raises(ConfigError, match=r"rerun.*XLAStrategy.*rerun=False"):
        _check_rerun(trainer, Net())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="rerun"):
        TrainGuard(rerun="training_step")


def test_manual_optimization_is_refused_with_rerun(tmp_path: Path) -> None:
    class Manual(Net):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    callback = TrainGuard(run_dir=tmp_path, hang_timeout=0, rerun=True)
    trainer = _trainer(callback, accumulate_grad_batches=1)  # Lightning's own rule
    with pytest.raises(ConfigError, match=r"manual optimization.*Guard\(rerun=loss_fn\)"):
        trainer.fit(Manual(), _loader())
