"""The Lightning callback in one process: a skipped step, what it refuses, lazy imports."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import trainguard as tg  # noqa: E402
from trainguard.errors import ConfigError  # noqa: E402
from trainguard.integrations.lightning import TrainGuard, training_step_loss  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "lightning_ddp.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("tg_lightning_example_unit", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trainer(callback: TrainGuard, **kwargs: Any) -> Any:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_importing_trainguard_imports_no_framework() -> None:
    code = (
        "import sys, trainguard, trainguard.integrations; "
        "assert not {'lightning', 'transformers'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_unknown_option_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="grad_clipping"):
        TrainGuard(grad_clipping=1.0)
    with pytest.raises(ConfigError, match="on_nonfinite"):
        TrainGuard(on_nonfinite="ignore")
    with pytest.raises(ConfigError, match="recovery"):  # the framework owns checkpoints
        TrainGuard(on_escalation="rollback")


def test_one_process_skips_the_poisoned_batch(tmp_path: Path) -> None:
    ex = _example()
    L.seed_everything(0, verbose=False)
    model = ex.Regressor()
    callback = TrainGuard(run_dir=tmp_path, hang_timeout=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(callback).fit(model, DataLoader(ex.Points(), batch_size=8))
    state = callback.state_dict()["state"]
    assert state["nonfinite_steps"] == [ex.POISONED // 8]  # one process: sample 27 in batch 3
    assert state["step"] == 8
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert len(list((tmp_path / "captures").glob("step-*"))) == 1
    fresh = ex.Regressor()  # as a replay factory builds it: no Trainer attached
    fresh.load_state_dict(model.state_dict())
    batch = ex.Points()[ex.POISONED]
    loss = training_step_loss(fresh, (batch[0][None], batch[1][None]))
    assert not math.isfinite(float(loss))


def test_a_second_fit_with_the_same_callback_starts_its_own_count(tmp_path: Path) -> None:
    ex = _example()
    callback = TrainGuard(run_dir=tmp_path, hang_timeout=0)
    for _ in range(2):  # two fits, no ckpt_path: the second is no resume of the first
        L.seed_everything(0, verbose=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _trainer(callback).fit(ex.Regressor(), DataLoader(ex.Points(), batch_size=8))
        state = callback.state_dict()["state"]  # the fit's final state, after it
        assert (state["step"], state["nonfinite_steps"]) == (8, [ex.POISONED // 8])
    starts = [e for e in tg.read_events(tmp_path, 0) if e["kind"] == "start"]
    assert [e["run_origin"] for e in starts] == ["new", "new"]


def test_a_fit_resumed_without_the_guards_state_counts_from_lightnings_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ex = _example()
    L.seed_everything(0, verbose=False)
    model = ex.Regressor()
    data = DataLoader(ex.Points(), batch_size=8)
    saver = L.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = TrainGuard(run_dir=tmp_path / "a", hang_timeout=0)
        trainer = L.Trainer(
            accelerator="cpu",
            max_epochs=1,
            callbacks=[first, saver],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, data)
        assert "save_checkpoint" not in vars(trainer)  # the Trainer's own method again
        phases = [e for e in tg.read_events(tmp_path / "a", 0) if e["kind"] == "phase"]
        saves = [(e["state"], e["step"]) for e in phases if e["phase"] == "checkpoint"]
        assert saves[:4] == [  # each write a phase: no hang while the others wait for it
            ("enter", 2),
            ("exit", 2),
            ("enter", 4),
            ("exit", 4),
        ]
        checkpoint = tmp_path / "ckpt" / "step=2.ckpt"
        saved = torch.load(checkpoint, weights_only=False)
        saved["callbacks"] = {k: v for k, v in saved["callbacks"].items() if k != "TrainGuard"}
        torch.save(saved, checkpoint)  # as saved by a Trainer without TrainGuard
        callback = TrainGuard(run_dir=tmp_path / "b", hang_timeout=0)
        _trainer(callback).fit(ex.Regressor(), data, ckpt_path=str(checkpoint))
    assert "without TrainGuard's state" in caplog.text
    state = callback.state_dict()["state"]
    assert state["step"] == 8  # Lightning's steps: 2 before the resume, 6 after
    # the plain loader starts the epoch over (Lightning fast-forwards its own count only):
    # the poisoned batch comes at Lightning's step 2 + 3, and the guard names that step
    assert state["nonfinite_steps"] == [2 + ex.POISONED // 8]


def test_manual_optimization_is_refused(tmp_path: Path) -> None:
    ex = _example()

    class Manual(ex.Regressor):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ConfigError, match="manual optimization"):
        _trainer(TrainGuard(run_dir=tmp_path, hang_timeout=0)).fit(
            Manual(), DataLoader(ex.Points(), batch_size=8)
        )


def test_fp16_with_a_grad_scaler_skips_after_lightnings_unscale(tmp_path: Path) -> None:
    """Lightning unscales before on_before_optimizer_step: clearing the gradients there must
    not trip GradScaler, the scale must drop, and the guard must see the unscaled loss."""
    from lightning.pytorch.plugins import MixedPrecision

    ex = _example()
    L.seed_everything(0, verbose=False)
    model = ex.Regressor()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)  # CPU has fp16 autocast in torch
    callback = TrainGuard(run_dir=tmp_path, hang_timeout=0)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(callback, plugins=[plugin]).fit(model, DataLoader(ex.Points(), batch_size=8))
    state = callback.state_dict()["state"]
    assert state["nonfinite_steps"] == [ex.POISONED // 8]
    assert scaler.get_scale() == 2.0**7  # the skipped step lowered the scale once
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert 1 < state["last_good_loss"] < 20  # unscaled: about 6 here; the scaled one is ~1500
    (bundle,) = (tmp_path / "captures").glob("step-*")  # the step's forward ran under fp16
    meta = json.loads((bundle / "rank-0" / "meta.json").read_text())
    assert meta["autocast"] == {"enabled": True, "device_type": "cpu", "dtype": "float16"}


def _bn_module(poisoned: int | None, drop: int | None) -> tuple[Any, Any]:
    """A LightningModule with BatchNorm, and 6 batches of 8; batch ``poisoned`` holds a NaN,
    batch ``drop`` is left out."""

    class BNRegressor(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, 8),
                torch.nn.BatchNorm1d(8),
                torch.nn.ReLU(),
                torch.nn.Linear(8, 1),
            )

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 4, generator=gen), torch.randn(48, generator=gen)
    if poisoned is not None:
        x[poisoned * 8 + 2, 0] = float("nan")
    keep = [i for i in range(48) if drop is None or i // 8 != drop]
    data = torch.utils.data.TensorDataset(x[keep], y[keep])
    L.seed_everything(0, verbose=False)
    return BNRegressor(), DataLoader(data, batch_size=8)


def test_a_skipped_step_leaves_batchnorm_as_if_the_batch_never_came(tmp_path: Path) -> None:
    model, loader = _bn_module(poisoned=2, drop=None)
    callback = TrainGuard(run_dir=tmp_path, hang_timeout=0, capture=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(callback).fit(model, loader)
        reference, ref_loader = _bn_module(poisoned=None, drop=2)
        _trainer(TrainGuard(run_dir=tmp_path / "ref", hang_timeout=0)).fit(reference, ref_loader)
    assert callback.state_dict()["state"]["nonfinite_steps"] == [2]
    want = reference.state_dict()
    for key, got in model.state_dict().items():
        assert torch.equal(got, want[key]), key  # running_mean/var, num_batches_tracked too


class _RecordingLogger(L.loggers.logger.Logger):  # type: ignore[misc]
    """A Lightning logger that keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))


_RECORDED: list[_RecordingLogger] = []
"""Every logger ``_fit_with_logger`` made (the last one: of a fit that raised)."""


def _fit_with_logger(tmp_path: Path, **options: Any) -> tuple[_RecordingLogger, Any]:
    ex = _example()
    L.seed_everything(0, verbose=False)
    logger = _RecordingLogger()
    _RECORDED.append(logger)
    callback = TrainGuard(run_dir=tmp_path, hang_timeout=0, capture=False, **options)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=[callback],
        logger=logger,
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(ex.Regressor(), DataLoader(ex.Points(), batch_size=8))
    return logger, ex


def test_guard_metrics_reach_the_trainers_logger(tmp_path: Path) -> None:
    logger, ex = _fit_with_logger(tmp_path)
    ours = [(step, m) for step, m in logger.calls if "trainguard/skipped_steps" in m]
    bad = ex.POISONED // 8  # one process: sample 27 sits in batch (= step) 3
    # every 2nd step as Lightning logs (log_every_n_steps=2), and the skipped step at once
    assert [step for step, _ in ours] == [1, bad, 5, 7]
    assert [m["trainguard/skipped_steps"] for _, m in ours] == [0, 1, 1, 1]
    assert [m["trainguard/step"] for _, m in ours] == [2, bad + 1, 6, 8]
    skipped = ours[1][1]
    assert skipped["trainguard/consecutive_bad"] == 1 and math.isinf(
        skipped["trainguard/grad_norm"]
    )
    assert all(type(v) in (int, float) for _, m in ours for v in m.values())  # no tensors
    lightnings = [step for step, m in logger.calls if "loss" in m]  # the module's self.log
    assert set(lightnings) >= {1, 5, 7}  # the same step numbers as Lightning's own


def test_the_step_that_ends_the_run_reaches_the_logger(tmp_path: Path) -> None:
    """An escalation raises out of the check: that step's numbers still reach the loggers
    (a dead run's dashboard shows the step that killed it)."""
    with pytest.raises(tg.NonFiniteError):
        _fit_with_logger(tmp_path, max_consecutive=1)
    ours = [(step, m) for step, m in _RECORDED[-1].calls if "trainguard/skipped_steps" in m]
    bad = _example().POISONED // 8
    step, last = ours[-1]
    assert step == bad and last["trainguard/consecutive_bad"] == 1
    assert last["trainguard/nonfinite_steps"] == 1 and not math.isfinite(last["trainguard/loss"])


def test_a_training_step_returning_none_has_an_unknown_loss_and_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Lightning skips a batch whose ``training_step`` returns None (no backward): the guard
    records the step with no loss (not 0.0), and does not take it for a ``check()`` called
    before ``backward()``."""
    ex = _example()

    class SkipsBatchTwo(ex.Regressor):  # type: ignore[misc,name-defined]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return None if batch_idx == 2 else super().training_step(batch, batch_idx)

    L.seed_everything(0, verbose=False)
    logger = _RecordingLogger()
    callback = TrainGuard(run_dir=tmp_path, hang_timeout=0, capture=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, callbacks=[callback], logger=logger,
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(SkipsBatchTwo(), DataLoader(ex.Points(poisoned=None), batch_size=8))
    events = tg.read_events(tmp_path, 0)
    assert not [e for e in events if e["kind"] == "check_without_gradients"]
    assert "found no gradient" not in caplog.text
    lines = [json.loads(line) for line in (tmp_path / "metrics" / "rank-0.jsonl").open()]
    losses = {line["step"]: line["losses"] for line in lines}
    assert losses[2] in ([], None) and all(losses[s] for s in losses if s != 2)
    ours = {step: m for step, m in logger.calls if "trainguard/step" in m}
    assert "trainguard/loss" not in ours[2] and "trainguard/loss" in ours[1]


def test_log_metrics_false_keeps_the_logger_clean(tmp_path: Path) -> None:
    logger, _ = _fit_with_logger(tmp_path, log_metrics=False)
    assert logger.calls and not any("trainguard/step" in m for _, m in logger.calls)
    with pytest.raises(ConfigError, match="log_metrics"):
        TrainGuard(log_metrics="yes")
