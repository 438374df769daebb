"""Overhead of the Lightning and HF Trainer integrations, measured the way overhead.py does.

Per framework, three modes run the same Trainer on the same model and data:

- ``bare``: no callback;
- ``trainguard``: ``TrainGuard`` / ``TrainGuardCallback`` (+ ``TrainGuardMixin``), capture on;
- ``nancapture``: the callback this project replaces: ``torch.isnan(torch.cat(all grads))``
  read on the host before every optimizer step (a full gradient copy and a sync per step).

Rounds are interleaved (every mode once per round, in a shuffled order) so that drift of a
shared machine hits every mode alike. A run's step time is the median of its step-to-step
intervals after ``--warmup`` steps (the Trainer's start-up is not timed). Per mode: the
median step time, and the ratio to ``bare`` as the median of the per-round ratios.

    python benchmarks/integrations_overhead.py --rounds 7 --out results/integrations.json
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import machine_info, markdown_table, median, now_iso, write_json
from torch import nn

MODES = ("bare", "trainguard", "nancapture")
FRAMEWORKS = ("lightning", "transformers")


class StepClock:
    """Step-to-step intervals, after ``warmup`` steps."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []

    def tick(self) -> None:
        self.times.append(time.perf_counter())

    def step_time(self) -> float:
        kept = self.times[self.warmup :]
        return median([b - a for a, b in itertools.pairwise(kept)])


def nan_capture_check(params: list[nn.Parameter]) -> None:
    """What NaNCapture did before every optimizer step (isnan only; one host sync)."""
    grads = [p.grad.flatten() for p in params if p.grad is not None]
    if grads and bool(torch.isnan(torch.cat(grads)).any()):
        logging.getLogger(__name__).warning("nan in gradients")


# -- Lightning ------------------------------------------------------------------------------


def run_lightning(mode: str, steps: int, warmup: int, width: int, run_dir: Path) -> float:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from trainguard.integrations.lightning import TrainGuard

    quiet()  # lightning sets its loggers to INFO when imported
    clock = StepClock(warmup)

    class Clock(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, *args: Any) -> None:
            clock.tick()

    class NanCapture(pl.Callback):  # type: ignore[misc]
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            nan_capture_check(list(module.parameters()))

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(steps * 16, width), torch.randn(steps * 16, width))
    callbacks: list[Any] = [Clock()]
    if mode == "trainguard":
        callbacks.append(TrainGuard(run_dir=run_dir, hang_timeout=0))
    elif mode == "nancapture":
        callbacks.append(NanCapture())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), DataLoader(data, batch_size=16))
    return clock.step_time()


# -- Hugging Face Trainer -------------------------------------------------------------------


def run_transformers(mode: str, steps: int, warmup: int, width: int, run_dir: Path) -> float:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from trainguard.integrations.transformers import TrainGuardCallback, TrainGuardMixin

    quiet()
    clock = StepClock(warmup)

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            clock.tick()

    class NanCapture(TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            nan_capture_check(list(model.parameters()))

    class Guarded(TrainGuardMixin, Trainer):  # type: ignore[misc]
        pass

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=64, n_embd=width, n_layer=2, n_head=4, bos_token_id=0
    )
    config.eos_token_id = 0
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 256, (steps * 4, 64))
    data = [{"input_ids": row, "labels": row} for row in ids]
    callbacks: list[Any] = [Clock()]
    trainer_class: Any = Trainer
    if mode == "trainguard":
        callbacks.append(TrainGuardCallback(run_dir=run_dir, hang_timeout=0))
        trainer_class = Guarded
    elif mode == "nancapture":
        callbacks.append(NanCapture())
    args = TrainingArguments(
        output_dir=str(run_dir / "trainer"),
        per_device_train_batch_size=4,
        max_steps=steps,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=10**6,
    )
    trainer = trainer_class(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # no metrics dict printed per run
    trainer.train()
    return clock.step_time()


RUNNERS: dict[str, Callable[[str, int, int, int, Path], float]] = {
    "lightning": run_lightning,
    "transformers": run_transformers,
}


def quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("trainguard").setLevel(logging.ERROR)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    times: dict[str, dict[str, list[float]]] = {f: {m: [] for m in MODES} for f in args.frameworks}
    order = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        for framework in args.frameworks:  # untimed: imports, first kernels, allocator
            RUNNERS[framework]("bare", args.steps, args.warmup, args.width, Path(tmp) / "warm")
        for r in range(args.rounds):
            for framework in args.frameworks:
                modes = list(MODES)
                order.shuffle(modes)
                for mode in modes:
                    run_dir = Path(tmp) / f"{framework}-{mode}-{r}"
                    seconds = RUNNERS[framework](mode, args.steps, args.warmup, args.width, run_dir)
                    times[framework][mode].append(seconds)
    results = []
    for framework, by_mode in times.items():
        for mode in MODES:
            ratios = [t / b for t, b in zip(by_mode[mode], by_mode["bare"], strict=True)]
            results.append(
                {
                    "framework": framework,
                    "mode": mode,
                    "step_ms": median(by_mode[mode]) * 1e3,
                    "ratio": median(ratios),
                    "step_ms_per_round": [t * 1e3 for t in by_mode[mode]],
                }
            )
    return {
        "benchmark": "integrations_overhead",
        "when": now_iso(),
        "machine": machine_info(),
        "settings": vars(args) | {"out": str(args.out) if args.out else None},
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.width = 2, 12, 3, 32
    logging.basicConfig(level=logging.ERROR)
    warnings.simplefilter("ignore")
    quiet()
    data = measure(args)
    rows = [
        [r["framework"], r["mode"], round(r["step_ms"], 3), round(r["ratio"], 4)]
        for r in data["results"]
    ]
    print(markdown_table(["framework", "mode", "step ms (median)", "x bare"], rows))
    load = data["machine"].get("load_average")
    print(f"\n{args.rounds} interleaved rounds, {args.steps} steps per run; load average {load}")
    if args.out is not None:
        write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
