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

The model is a GPT-2 (``GPT2LMHeadModel`` from a ``GPT2Config``, no download) in both
frameworks. ``--workload transformer`` (the default) has the sizes of ``overhead.py``'s
transformer workload on CPU (vocab 4096, dim 256, 4 layers, 4 heads, seq 128, batch 8), the
workload the issue's 1.02x target names; ``--workload tiny`` (vocab 256, dim 128, 2 layers,
seq 64, batch 4) has a step of a few ms, where any fixed per-step cost shows.

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
WORKLOADS: dict[str, dict[str, int]] = {
    "transformer": {"vocab": 4096, "dim": 256, "layers": 4, "heads": 4, "seq": 128, "batch": 8},
    "tiny": {"vocab": 256, "dim": 128, "layers": 2, "heads": 4, "seq": 64, "batch": 4},
}


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


def gpt2(sizes: dict[str, int]) -> nn.Module:
    """The benchmark's GPT-2, built from a config (seeded: every mode starts the same)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=sizes["vocab"],
        n_positions=sizes["seq"],
        n_embd=sizes["dim"],
        n_layer=sizes["layers"],
        n_head=sizes["heads"],
        bos_token_id=0,
    )
    config.eos_token_id = 0
    return GPT2LMHeadModel(config)


def token_ids(sizes: dict[str, int], steps: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, sizes["vocab"], (steps * sizes["batch"], sizes["seq"]), generator=gen)


# -- Lightning ------------------------------------------------------------------------------


def run_lightning(
    mode: str, steps: int, warmup: int, sizes: dict[str, int], run_dir: Path
) -> float:
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
            self.net = gpt2(sizes)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            loss: torch.Tensor = self.net(input_ids=ids, labels=ids).loss
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    data = TensorDataset(token_ids(sizes, steps))
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
    trainer.fit(Model(), DataLoader(data, batch_size=sizes["batch"]))
    return clock.step_time()


# -- Hugging Face Trainer -------------------------------------------------------------------


def run_transformers(
    mode: str, steps: int, warmup: int, sizes: dict[str, int], run_dir: Path
) -> float:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

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

    model = gpt2(sizes)
    data = [{"input_ids": row, "labels": row} for row in token_ids(sizes, steps)]
    callbacks: list[Any] = [Clock()]
    trainer_class: Any = Trainer
    if mode == "trainguard":
        callbacks.append(TrainGuardCallback(run_dir=run_dir, hang_timeout=0))
        trainer_class = Guarded
    elif mode == "nancapture":
        callbacks.append(NanCapture())
    args = TrainingArguments(
        output_dir=str(run_dir / "trainer"),
        per_device_train_batch_size=sizes["batch"],
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


RUNNERS: dict[str, Callable[[str, int, int, dict[str, int], Path], float]] = {
    "lightning": run_lightning,
    "transformers": run_transformers,
}


def quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("trainguard").setLevel(logging.ERROR)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    times: dict[str, dict[str, list[float]]] = {f: {m: [] for m in MODES} for f in args.frameworks}
    sizes = WORKLOADS[args.workload]
    order = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        for framework in args.frameworks:  # untimed: imports, first kernels, allocator
            RUNNERS[framework]("bare", args.steps, args.warmup, sizes, Path(tmp) / "warm")
        for r in range(args.rounds):
            for framework in args.frameworks:
                modes = list(MODES)
                order.shuffle(modes)
                for mode in modes:
                    run_dir = Path(tmp) / f"{framework}-{mode}-{r}"
                    seconds = RUNNERS[framework](mode, args.steps, args.warmup, sizes, run_dir)
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
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="transformer")
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.workload = 2, 12, 3, "tiny"
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
    print(
        f"\n{args.workload} workload {WORKLOADS[args.workload]}; {args.rounds} interleaved "
        f"rounds, {args.steps} steps per run; load average {load}"
    )
    if args.out is not None:
        write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
