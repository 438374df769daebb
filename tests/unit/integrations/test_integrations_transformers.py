"""The HF Trainer integration in one process: bad parameters named before the clip, the
whole accumulation window captured, and what it refuses."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import trainguard as tg
from trainguard.errors import ConfigError
from trainguard.integrations.transformers import (
    TrainGuardCallback,
    model_loss,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hf_trainer.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("tg_hf_example_unit", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(tmp_path: Path, **kwargs: Any) -> TrainingArguments:
    options: dict[str, Any] = dict(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=1,
        max_steps=4,
        learning_rate=1e-3,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    options.update(kwargs)
    return TrainingArguments(**options)


def test_bad_parameter_is_named_before_the_clip(tmp_path: Path) -> None:
    ex = _example()
    model = ex.tiny_gpt2()
    target = model.transformer.ln_f.weight
    backwards = {"n": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        backwards["n"] += 1
        return grad * float("nan") if backwards["n"] == 2 else grad

    target.register_hook(poison)
    callback = TrainGuardCallback(run_dir=tmp_path, hang_timeout=0, capture=False)
    trainer = ex.GuardedTrainer(
        model=model,
        args=_args(tmp_path, max_grad_norm=1.0, eval_strategy="steps", eval_steps=2),
        train_dataset=ex.Tokens(masked=None),  # the Trainer's clip would spread the NaN
        eval_dataset=ex.Tokens(2, masked=None),
        callbacks=[callback],
    )
    trainer.train()
    phases = [e for e in tg.read_events(tmp_path, 0) if e["kind"] == "phase"]
    assert [(e["phase"], e["state"]) for e in phases][:2] == [
        ("evaluation", "enter"),
        ("evaluation", "exit"),
    ]
    bad = [e for e in tg.read_events(tmp_path, 0) if e["kind"] == "nonfinite"]
    assert [e["step"] for e in bad] == [1]
    assert bad[0]["params"] == ["transformer.ln_f.weight"]  # only it, not every parameter
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_whole_accumulation_window_is_captured(tmp_path: Path) -> None:
    ex = _example()
    model = ex.tiny_gpt2()
    backwards = {"n": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:  # the 2nd micro-batch of step 1
        backwards["n"] += 1
        return grad * float("nan") if backwards["n"] == 4 else grad

    model.transformer.ln_f.bias.register_hook(poison)
    callback = TrainGuardCallback(run_dir=tmp_path, hang_timeout=0)
    trainer = ex.GuardedTrainer(
        model=model,
        args=_args(tmp_path, gradient_accumulation_steps=2),
        train_dataset=ex.Tokens(masked=None),
        callbacks=[callback],
    )
    trainer.train()
    assert callback.final_state is not None
    assert callback.final_state["state"]["nonfinite_steps"] == [1]
    bundle = next((tmp_path / "captures").glob("step-*"))
    meta = json.loads((bundle / "rank-0" / "meta.json").read_text())
    assert meta["micro_batches"] == 2 and len(meta["micro_losses"]) == 2
    assert meta["nonfinite_params"] == ["transformer.ln_f.bias"]
    saved = torch.load(bundle / "rank-0" / "batch.pt", weights_only=False)
    assert (
        len(saved["micro_batches"]) == 2
    )  # both micro-batches of the window, as the Trainer fetched them


def test_callback_without_the_mixin_is_refused_before_any_forward(tmp_path: Path) -> None:
    ex = _example()
    model = ex.tiny_gpt2()
    forwards = {"n": 0}

    def count(module: Any, args: Any) -> None:
        forwards["n"] += 1

    model.register_forward_pre_hook(count)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path),
        train_dataset=ex.Tokens(masked=None),
        callbacks=[TrainGuardCallback(run_dir=tmp_path, hang_timeout=0)],
    )
    with pytest.raises(ConfigError, match=r"class MyTrainer\(TrainGuardMixin, Trainer\)"):
        trainer.train()
    assert forwards["n"] == 0  # refused in on_train_begin: no forward, no backward ran


def test_a_train_that_raises_closes_the_guard_and_a_retry_gets_its_own(tmp_path: Path) -> None:
    ex = _example()
    model = ex.tiny_gpt2()
    backwards = {"n": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        backwards["n"] += 1
        return grad * float("nan") if backwards["n"] == 2 else grad

    model.transformer.ln_f.weight.register_hook(poison)
    callback = TrainGuardCallback(run_dir=tmp_path, hang_timeout=0, on_nonfinite="raise")
    trainer = ex.GuardedTrainer(
        model=model,
        args=_args(tmp_path),
        train_dataset=ex.Tokens(masked=None),
        callbacks=[callback],
    )
    with pytest.raises(tg.NonFiniteError):  # a notebook or a sweep catches it
        trainer.train()
    assert callback.guard is None and callback.final_state is not None  # closed at once
    closes = [e for e in tg.read_events(tmp_path, 0) if e["kind"] == "close"]
    assert len(closes) == 1 and "NonFiniteError" in closes[0]["error"]
    trainer.train()  # the retry: a guard of its own, no clash with a stale one
    closes = [e for e in tg.read_events(tmp_path, 0) if e["kind"] == "close"]
    assert len(closes) == 2 and not closes[1].get("error") and closes[1].get("closed") is not False


def test_mixin_without_the_callback_is_refused(tmp_path: Path) -> None:
    ex = _example()
    trainer = ex.GuardedTrainer(
        model=ex.tiny_gpt2(), args=_args(tmp_path), train_dataset=ex.Tokens(masked=None)
    )
    with pytest.raises(ConfigError, match="TrainGuardCallback"):
        trainer.train()


def test_unknown_option_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_grad_norm"):
        TrainGuardCallback(max_grad_norm=1.0)


def test_model_loss_is_the_models_own_loss() -> None:
    ex = _example()
    model = ex.tiny_gpt2().eval()  # no dropout: the two losses are comparable
    batch = {k: v[None] for k, v in ex.Tokens(masked=None)[0].items()}
    assert torch.allclose(model_loss(model, batch), model(**batch).loss)
    masked = {k: v[None] for k, v in ex.Tokens()[ex.MASKED].items()}
    assert math.isnan(float(model_loss(model, masked)))


class _LogReader(TrainerCallback):  # type: ignore[misc]
    """Keeps the ``logs`` every ``on_log`` receives (as W&B / TensorBoard reporters do)."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.logs.append(dict(logs or {}))


def test_guard_metrics_reach_the_reporters_logs(tmp_path: Path) -> None:
    ex = _example()
    reader = _LogReader()
    trainer = ex.GuardedTrainer(
        model=ex.tiny_gpt2(),
        args=_args(tmp_path, max_steps=8, logging_steps=1, average_tokens_across_devices=False),
        train_dataset=ex.Tokens(),  # sample MASKED is all -100: its step's loss is NaN
        callbacks=[reader, TrainGuardCallback(run_dir=tmp_path, hang_timeout=0, capture=False)],
    )
    trainer.train()  # the reader comes first, as the report_to reporters do, and still sees them
    steps = [log for log in reader.logs if "loss" in log]
    assert len(steps) == 8
    assert all("trainguard/skipped_steps" in log for log in steps)
    [skip] = [e["step"] for e in tg.read_events(tmp_path, 0) if e["kind"] == "skip"]
    assert [log["trainguard/skipped_steps"] for log in steps] == [0] * skip + [1] * (8 - skip)
    assert [log["trainguard/step"] for log in steps] == list(range(1, 9))
    bad = steps[skip]
    assert bad["trainguard/consecutive_bad"] == 1 and math.isnan(bad["trainguard/loss"])
    keys = {"trainguard/grad_norm", "trainguard/lr_factor", "trainguard/spikes"}
    assert keys <= set(steps[0])
    summary = reader.logs[-1]  # train_runtime, train_loss...: the final counts ride along
    assert "train_loss" in summary and summary["trainguard/skipped_steps"] == 1
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert history[-1]["trainguard/skipped_steps"] == 1


def test_the_step_that_ends_the_run_reaches_the_reporters(tmp_path: Path) -> None:
    """An escalation raises out of the check: that step's numbers still reach the reporters'
    ``on_log`` and the log history (a dead run's dashboard shows the step that killed it)."""
    ex = _example()
    reader = _LogReader()
    options = {"run_dir": tmp_path, "hang_timeout": 0, "capture": False, "max_consecutive": 1}
    trainer = ex.GuardedTrainer(
        model=ex.tiny_gpt2(),
        args=_args(tmp_path, max_steps=8, logging_steps=4, average_tokens_across_devices=False),
        train_dataset=ex.Tokens(),  # sample MASKED is all -100: its step's loss is NaN
        callbacks=[reader, TrainGuardCallback(**options)],
    )
    with pytest.raises(tg.NonFiniteError):
        trainer.train()
    [escalated] = [e["step"] for e in tg.read_events(tmp_path, 0) if e["kind"] == "escalate"]
    last = reader.logs[-1]
    assert last["trainguard/step"] == escalated + 1 and last["trainguard/nonfinite_steps"] == 1
    assert last["trainguard/consecutive_bad"] == 1 and math.isnan(last["trainguard/loss"])
    assert trainer.state.log_history[-1]["trainguard/nonfinite_steps"] == 1


def test_an_evaluation_without_the_callback_is_a_plain_one(tmp_path: Path) -> None:
    """The mixin's Trainer class reused for an evaluation-only run (no callback): nothing to
    guard, the Trainer's own ``evaluate``."""
    ex = _example()
    trainer = ex.GuardedTrainer(
        model=ex.tiny_gpt2(), args=_args(tmp_path), eval_dataset=ex.Tokens(2, masked=None)
    )
    assert "eval_loss" in trainer.evaluate()


def test_under_accumulation_the_guards_loss_is_the_trainers(tmp_path: Path) -> None:
    """The Trainer's training_step returns each micro-batch's share of the window's loss; the
    guard reports the window's loss, as the Trainer logs it (not half of it)."""
    ex = _example()
    reader = _LogReader()
    trainer = ex.GuardedTrainer(
        model=ex.tiny_gpt2(),
        args=_args(tmp_path, max_steps=3, logging_steps=1, gradient_accumulation_steps=2),
        train_dataset=ex.Tokens(masked=None),
        callbacks=[reader, TrainGuardCallback(run_dir=tmp_path, hang_timeout=0, capture=False)],
    )
    trainer.train()
    steps = [log for log in reader.logs if "loss" in log]
    assert len(steps) == 3
    for log in steps:  # the Trainer rounds its logged loss to 4 decimals
        assert log["trainguard/loss"] == pytest.approx(log["loss"], abs=1e-3), log


def test_resume_from_a_trainer_checkpoint_continues_the_guards_state(tmp_path: Path) -> None:
    """The guard's state rides in the Trainer's checkpoints: a resumed train() names the
    Trainer's steps and keeps the bad steps counted before the checkpoint."""
    ex = _example()

    def train(max_steps: int, resume: bool) -> TrainGuardCallback:
        callback = TrainGuardCallback(run_dir=tmp_path / "run", hang_timeout=0, capture=False)
        trainer = ex.GuardedTrainer(
            model=ex.tiny_gpt2(),
            args=_args(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=8),
            train_dataset=ex.Tokens(),  # sample MASKED is all -100: its step is bad
            callbacks=[callback],
        )
        trainer.train(resume_from_checkpoint=True if resume else None)
        return callback

    first = train(8, resume=False)
    assert first.final_state is not None
    bad = first.final_state["state"]["nonfinite_steps"]
    assert len(bad) == 1 and bad[0] < 8  # the masked sample came before the checkpoint
    assert (tmp_path / "trainer" / "checkpoint-8" / "trainguard_state.pt").is_file()
    phases = [e for e in tg.read_events(tmp_path / "run", 0) if e["kind"] == "phase"]
    assert [(e["phase"], e["state"], e["step"]) for e in phases] == [
        ("checkpoint", "enter", 8),  # the write is a phase: no hang while the others wait
        ("checkpoint", "exit", 8),
    ]
    resumed = train(12, resume=True)
    assert resumed.final_state is not None
    state = resumed.final_state["state"]
    assert state["step"] == 12 and state["nonfinite_steps"] == bad
    assert state["total_nonfinite"] == 1
    checked = [e["step"] for e in tg.read_events(tmp_path / "run", 0) if e["kind"] == "close"]
    assert checked == [8, 12]  # the resumed run closed at the Trainer's step, not at 4


def test_log_metrics_false_leaves_the_logs_alone(tmp_path: Path) -> None:
    ex = _example()
    reader = _LogReader()
    trainer = ex.GuardedTrainer(
        model=ex.tiny_gpt2(),
        args=_args(tmp_path, max_steps=2, logging_steps=1),
        train_dataset=ex.Tokens(masked=None),
        callbacks=[TrainGuardCallback(run_dir=tmp_path, hang_timeout=0, log_metrics=False), reader],
    )
    trainer.train()
    assert reader.logs and not any(k.startswith("trainguard/") for log in reader.logs for k in log)


def test_a_trainers_own_loss_is_named_and_a_model_loss_replay_says_it_did_not_compute_it(
    tmp_path: Path,
) -> None:
    """A Trainer whose ``compute_loss`` computes the loss itself (here: scaled by a weight
    that is NaN at one step): the bundle's ``meta.json`` names it (``loss_source``), and a
    replay with ``replay_spec`` (the model's own loss, finite) says that it did not compute
    the run's loss, instead of a transient fault that points at the device."""
    from trainguard.integrations.transformers import replay_spec

    ex = _example()
    calls = {"n": 0}

    class WeightedTrainer(ex.GuardedTrainer):  # type: ignore[misc,name-defined]
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            loss = model(**inputs).loss
            return loss * (float("nan") if calls["n"] == 2 else 1.0)

    model = ex.tiny_gpt2()
    callback = TrainGuardCallback(run_dir=tmp_path, hang_timeout=0)
    trainer = WeightedTrainer(
        model=model,
        args=_args(tmp_path),
        train_dataset=ex.Tokens(masked=None),
        callbacks=[callback],
    )
    trainer.train()
    bundle = next((tmp_path / "captures").glob("step-*"))
    meta = json.loads((bundle / "rank-0" / "meta.json").read_text())
    assert meta["loss_source"].endswith("WeightedTrainer.compute_loss")
    report = tg.replay(bundle, lambda: replay_spec(ex.tiny_gpt2()), repeats=1)
    assert not report.reproduced and report.verdict == "loss_not_replayed"
    assert "the replay did not compute the loss the run did" in report.summary
    assert "WeightedTrainer.compute_loss" in report.summary
    assert report.advice.startswith("Write the factory's loss_fn with the run's own loss")


def _scaled_run(tmp_path: Path, fault: str, guarded: bool) -> tuple[dict[str, Any], float, float]:
    """The Trainer with a GradScaler on its accelerator (fp16 on a GPU; a CPU GradScaler put
    there here, as accelerate does on a GPU), 6 steps, max_grad_norm 1: ``fault`` "grad" makes
    one gradient NaN at the third backward, "loss" feeds a fully masked sample (loss 0/0)."""
    ex = _example()
    torch.manual_seed(0)
    model = ex.tiny_gpt2()
    if fault == "grad":
        backwards = {"n": 0}

        def poison(grad: torch.Tensor) -> torch.Tensor:
            backwards["n"] += 1
            return grad * float("nan") if backwards["n"] == 3 else grad

        model.transformer.ln_f.weight.register_hook(poison)
    callbacks = [TrainGuardCallback(run_dir=tmp_path / "run", hang_timeout=0)] if guarded else []
    trainer = (ex.GuardedTrainer if guarded else Trainer)(
        model=model,
        args=_args(tmp_path / ("guarded" if guarded else "bare"), max_grad_norm=1.0, max_steps=6),
        train_dataset=ex.Tokens(6, masked=None if fault == "grad" else 3),  # all 6 drawn
        callbacks=callbacks,
    )
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    trainer.train()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    steps = float(next(iter(trainer.optimizer.optimizer.state.values()))["step"])
    return weights, trainer.accelerator.scaler.get_scale(), steps


def test_fp16_with_a_grad_scaler_leaves_a_nan_gradient_to_the_scaler(tmp_path: Path) -> None:
    """With the Trainer's GradScaler the check waits for ``on_pre_optimizer_step`` (after the
    clip's unscale). A NaN gradient with a finite loss cannot be told from an fp16 overflow:
    the scaler's skip, an ``overflow`` event; the weights and the scale bit for bit the bare
    Trainer's, whose scaler leaves it out itself."""
    bare, bare_scale, bare_steps = _scaled_run(tmp_path, "grad", guarded=False)
    weights, scale, steps = _scaled_run(tmp_path, "grad", guarded=True)
    assert (scale, steps) == (bare_scale, bare_steps) == (2.0**15, 5.0)  # one left out
    for key, want in bare.items():
        assert torch.equal(weights[key], want), key
    kinds = [e["kind"] for e in tg.read_events(tmp_path / "run", 0)]
    assert kinds.count("overflow") == 1 and "skip" not in kinds


def test_fp16_with_a_grad_scaler_skips_a_nan_loss_through_the_scaler(tmp_path: Path) -> None:
    """A fully masked sample: loss 0/0, gradients zero. Bare, the scaler sees finite
    gradients and AdamW steps on them (its moments still move the weights); guarded, the step
    is skipped on every rank by marking the scaler's overflow: the scaler leaves the update out
    and lowers its scale. Before, the skip cleared the gradients before the scaler's check,
    which raised at ``optimizer.step()`` ("No inf checks were recorded for this optimizer")."""
    _, bare_scale, bare_steps = _scaled_run(tmp_path, "loss", guarded=False)
    weights, scale, steps = _scaled_run(tmp_path, "loss", guarded=True)
    assert (bare_scale, bare_steps) == (2.0**16, 6.0)
    assert (scale, steps) == (2.0**15, 5.0)
    assert all(torch.isfinite(w).all() for w in weights.values())
    kinds = [e["kind"] for e in tg.read_events(tmp_path / "run", 0)]
    assert kinds.count("skip") == 1
