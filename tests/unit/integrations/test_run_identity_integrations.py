"""The integrations' resume path continues the run: Lightning's ``fit(ckpt_path=...)`` and the
Trainer's ``resume_from_checkpoint`` (a ``global_step`` > 0 at ``on_train_begin``)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trainguard.events import read_events

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "lightning_ddp.py"


def _starts(run_dir: Path) -> list[tuple[str, str]]:
    return [(e["run"], e["run_origin"]) for e in read_events(run_dir) if e["kind"] == "start"]


def test_lightning_fit_from_a_checkpoint_continues_the_run(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader

    from trainguard.integrations.lightning import TrainGuard

    spec = importlib.util.spec_from_file_location("tg_lightning_example_runs", EXAMPLE)
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    run_dir, ckpt = tmp_path / "run", tmp_path / "last.ckpt"

    def fit(max_epochs: int, ckpt_path: Path | None) -> None:
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=max_epochs,
            callbacks=[TrainGuard(run_dir=run_dir, hang_timeout=0)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = DataLoader(ex.Points(poisoned=None), batch_size=16)
            trainer.fit(ex.Regressor(), loader, ckpt_path=ckpt_path)
        trainer.save_checkpoint(ckpt)

    fit(1, None)
    fit(2, ckpt)  # resumed: the same run goes on
    fit(1, None)  # a fresh fit: a new run
    (first, o1), (resumed, o2), (fresh, o3) = _starts(run_dir)
    assert first == resumed != fresh
    assert (o1, o2, o3) == ("new", "resume", "new")


def test_transformers_resume_from_checkpoint_continues_the_run(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from trainguard.integrations.transformers import TrainGuardCallback, TrainGuardMixin

    class Trainer(TrainGuardMixin):
        """Stands for ``class MyTrainer(TrainGuardMixin, Trainer)``: only the hook is called."""

    def begin(global_step: int) -> None:
        model = torch.nn.Linear(2, 1)
        callback = TrainGuardCallback(run_dir=tmp_path, hang_timeout=0)
        callback.bind(Trainer())
        args = SimpleNamespace(deepspeed=None, gradient_accumulation_steps=1)
        state: Any = SimpleNamespace(global_step=global_step)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        callback.on_train_begin(args, state, None, model=model, optimizer=optimizer)
        callback.close()

    begin(0)
    begin(40)  # trainer.train(resume_from_checkpoint=...): the state says step 40
    begin(0)
    (first, o1), (resumed, o2), (fresh, o3) = _starts(tmp_path)
    assert first == resumed != fresh
    assert (o1, o2, o3) == ("new", "resume", "new")
