"""``TrainGuardCallback(rerun=True)`` in one process: a tiny GPT-2 (dropout on) under the HF
Trainer, two micro-batches a step. A one-off NaN is rerun through the Trainer's own
``training_step`` (``transient``), the step counts, and the run ends bit-identical to one
without the fault; a NaN the rerun reproduces is ``persistent`` and skipped; what the rerun
cannot do is refused at setup."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from torch import Tensor, nn
from transformers import Trainer, TrainingArguments

import trainguard as tg
from trainguard.errors import ConfigError
from trainguard.integrations.transformers import TrainGuardCallback

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hf_trainer.py"
FAULT_STEP = 1


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("tg_hf_example_rerun", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(tmp_path: Path, **kwargs: Any) -> TrainingArguments:
    options: dict[str, Any] = dict(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-2,
        max_grad_norm=1.0,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    options.update(kwargs)
    return TrainingArguments(**options)


class OneOff:
    """Poisons the module's output in the first forward of ``step`` (the rerun is clean)."""

    def __init__(self, module: nn.Module, callback: TrainGuardCallback) -> None:
        self.callback, self.done = callback, False
        module.register_forward_hook(self)

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        guard = self.callback.guard
        if self.done or guard is None or guard.state.step != FAULT_STEP:
            return None
        self.done = True
        return output * float("nan")


def _train(
    tmp_path: Path, fault: str | None, **args: Any
) -> tuple[dict[str, Tensor], TrainGuardCallback]:
    """``fault``: None, ``"once"`` (one poisoned forward) or ``"always"`` (a NaN weight in
    the step: every forward of it is bad, the rerun's too); ``args``: TrainingArguments."""
    ex = _example()
    torch.manual_seed(0)
    model = ex.tiny_gpt2()
    assert model.config.resid_pdrop > 0  # dropout on: the rerun must draw the same masks
    callback = TrainGuardCallback(run_dir=tmp_path / "run", hang_timeout=0, rerun=True)
    if fault == "once":
        OneOff(model.transformer.h[0].mlp, callback)
    elif fault == "always":

        def poison(module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
            guard = callback.guard
            return output * float("nan") if guard and guard.state.step == FAULT_STEP else None

        model.transformer.h[0].mlp.register_forward_hook(poison)
    trainer = ex.GuardedTrainer(
        model=model,
        args=_args(tmp_path, **args),
        train_dataset=ex.Tokens(masked=None),
        callbacks=[callback],
    )
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, callback


def _kinds(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in tg.read_events(tmp_path / "run", 0) if e["kind"] == kind]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_one_off_nan_is_rerun_and_costs_nothing(tmp_path: Path, bf16: bool) -> None:
    """bf16: the Trainer's step enters its own autocast and runs its backward outside it; the
    rerun must not put that backward inside one (its gradients would differ)."""
    clean, _ = _train(tmp_path / "clean", None, bf16=bf16)
    weights, callback = _train(tmp_path / "fault", "once", bf16=bf16)
    reruns = _kinds(tmp_path / "fault", "rerun")
    assert [(e["step"], e["verdict"]) for e in reruns] == [(FAULT_STEP, "transient")]
    assert not _kinds(tmp_path / "fault", "skip")
    assert callback.final_state is not None
    assert callback.final_state["state"]["total_nonfinite"] == 0
    assert callback.final_state["state"]["step"] == 4
    for key, want in clean.items():  # the dropout masks, the accumulation: all the same
        assert torch.equal(weights[key], want), key


def test_a_nan_the_rerun_reproduces_is_skipped(tmp_path: Path) -> None:
    weights, callback = _train(tmp_path, "always")
    reruns = _kinds(tmp_path, "rerun")
    assert [(e["step"], e["verdict"]) for e in reruns] == [(FAULT_STEP, "persistent")]
    assert [e["step"] for e in _kinds(tmp_path, "skip")] == [FAULT_STEP]
    assert callback.final_state is not None
    assert callback.final_state["state"]["nonfinite_steps"] == [FAULT_STEP]
    assert all(torch.isfinite(w).all() for w in weights.values())


def _refused(tmp_path: Path, trainer_cls: Any = None, **kwargs: Any) -> None:
    ex = _example()
    trainer = (trainer_cls or ex.GuardedTrainer)(
        model=ex.tiny_gpt2(),
        args=_args(tmp_path, **kwargs),
        train_dataset=ex.Tokens(masked=None),
        callbacks=[TrainGuardCallback(run_dir=tmp_path, hang_timeout=0, rerun=True)],
    )
    trainer.train()


def test_fp16_with_a_grad_scaler_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rerun.*fp16.*bf16=True"):
        _refused(tmp_path, fp16=True)


def test_rerun_without_the_mixin_is_refused_at_setup(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rerun.*TrainGuardMixin"):
        _refused(tmp_path, trainer_cls=Trainer)


def test_rerun_takes_true_or_false() -> None:
    with pytest.raises(ConfigError, match="rerun"):
        TrainGuardCallback(rerun="training_step")
