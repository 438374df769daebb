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

CPU time: each step is also timed in the process's CPU time (``time.process_time``, all its
threads). With ``--threads 1`` a step's CPU time is its compute cost, not counting the time
the VM's other tenants or processes took the core away; the ``cpu_`` ratios are formed the
same way as the wall-time ones.

``--by-step``: the runs of this VM differ by up to +-15% from one another in step time (the
same mode, the same process, minutes apart), more than the 2% being measured. With
``--by-step`` each mode's callback acts only on even steps of its run, and the run's ratio is
the median even-step time over the median odd-step time: every comparison is between steps
of one run (same model, same memory, same minute). ``bare`` then gives the null ratio of the
alternation itself. What it cannot see: a cost the callback's presence puts on every step of
its run, the unguarded ones too (it cancels out of the ratio); compare whole runs for that.

    python benchmarks/integrations_overhead.py --rounds 7 --out results/integrations.json
    python benchmarks/integrations_overhead.py --by-step --frameworks transformers
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
    """Step-to-step intervals, after ``warmup`` steps: wall time, and the process's CPU time
    (every thread of it: a background thread of the callback counts)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def tick(self) -> None:
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.process_time())

    def _ticks(self, cpu: bool) -> list[float]:
        return self.cpu_times if cpu else self.times

    def step_time(self, cpu: bool = False) -> float:
        kept = self._ticks(cpu)[self.warmup :]
        return median([b - a for a, b in itertools.pairwise(kept)])

    def parity_ratio(self, cpu: bool = False) -> float:
        """Median time of the even steps over that of the odd steps (tick k ends step k)."""
        ticks = list(enumerate(self._ticks(cpu)))[self.warmup :]
        by_parity: dict[int, list[float]] = {0: [], 1: []}
        for (_, a), (k, b) in itertools.pairwise(ticks):
            by_parity[k % 2].append(b - a)
        return median(by_parity[0]) / median(by_parity[1])


def acts_on(step: int, by_step: bool) -> bool:
    """Whether a mode's callback acts on ``step``: every step, or the even ones with
    ``--by-step``."""
    return not by_step or step % 2 == 0


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
    mode: str, steps: int, warmup: int, sizes: dict[str, int], run_dir: Path, by_step: bool
) -> StepClock:
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
            if acts_on(trainer.global_step, by_step):
                nan_capture_check(list(module.parameters()))

    class EvenSteps(TrainGuard):  # type: ignore[misc]
        """``--by-step``: the guard on even steps only (``global_step`` is the step's index
        in all three hooks; the guard sees every other step as its own steps)."""

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if acts_on(trainer.global_step, by_step):
                super().on_train_batch_start(trainer, *args)

        def on_before_backward(self, trainer: Any, *args: Any) -> None:
            if acts_on(trainer.global_step, by_step):
                super().on_before_backward(trainer, *args)

        def on_before_optimizer_step(self, trainer: Any, *args: Any) -> None:
            if acts_on(trainer.global_step, by_step):
                super().on_before_optimizer_step(trainer, *args)

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
        guard_class = EvenSteps if by_step else TrainGuard
        callbacks.append(guard_class(run_dir=run_dir, hang_timeout=0))
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
    return clock


# -- Hugging Face Trainer -------------------------------------------------------------------


def run_transformers(
    mode: str, steps: int, warmup: int, sizes: dict[str, int], run_dir: Path, by_step: bool
) -> StepClock:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from trainguard.integrations.transformers import TrainGuardCallback, TrainGuardMixin

    quiet()
    clock = StepClock(warmup)

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            clock.tick()

    class NanCapture(TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, args: Any, state: Any, *rest: Any, **kwargs: Any) -> None:
            if acts_on(state.global_step, by_step):
                nan_capture_check(list(model.parameters()))

    class EvenSteps(TrainGuardCallback):  # type: ignore[misc]
        """``--by-step``: the guard on even steps only (one micro-batch per step here)."""

        step = 0

        def before_micro_batch(self, inputs: Any) -> None:
            if acts_on(self.step, by_step):
                super().before_micro_batch(inputs)

        def after_micro_batch(
            self, loss: torch.Tensor, last_of_step: bool, window: int = 1
        ) -> None:
            if acts_on(self.step, by_step):
                super().after_micro_batch(loss, last_of_step, window)
            else:
                self._checked = True  # the mixin is there; this step is left unguarded

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.step += 1

    class Guarded(TrainGuardMixin, Trainer):  # type: ignore[misc]
        pass

    model = gpt2(sizes)
    data = [{"input_ids": row, "labels": row} for row in token_ids(sizes, steps)]
    callbacks: list[Any] = [Clock()]
    trainer_class: Any = Trainer
    if mode == "trainguard":
        guard_class = EvenSteps if by_step else TrainGuardCallback
        callbacks.append(guard_class(run_dir=run_dir, hang_timeout=0))
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
    return clock


RUNNERS: dict[str, Callable[[str, int, int, dict[str, int], Path, bool], StepClock]] = {
    "lightning": run_lightning,
    "transformers": run_transformers,
}


def quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("trainguard").setLevel(logging.ERROR)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    clocks: dict[str, dict[str, list[StepClock]]] = {
        f: {m: [] for m in MODES} for f in args.frameworks
    }
    sizes = WORKLOADS[args.workload]
    order = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        for framework in args.frameworks:  # untimed: imports, first kernels, allocator
            warm = Path(tmp) / "warm"
            RUNNERS[framework]("bare", args.steps, args.warmup, sizes, warm, args.by_step)
        for r in range(args.rounds):
            for framework in args.frameworks:
                modes = list(MODES)
                order.shuffle(modes)
                for mode in modes:
                    run_dir = Path(tmp) / f"{framework}-{mode}-{r}"
                    clock = RUNNERS[framework](
                        mode, args.steps, args.warmup, sizes, run_dir, args.by_step
                    )
                    clocks[framework][mode].append(clock)
    results = [
        summarize(framework, mode, by_mode[mode], by_mode["bare"], args.by_step)
        for framework, by_mode in clocks.items()
        for mode in MODES
    ]
    return {
        "benchmark": "integrations_overhead",
        "when": now_iso(),
        "machine": machine_info(),
        "settings": vars(args)
        | {"out": str(args.out) if args.out else None, "torch_threads": torch.get_num_threads()},
        "results": results,
    }


def summarize(
    framework: str, mode: str, runs: list[StepClock], bare: list[StepClock], by_step: bool
) -> dict[str, Any]:
    """One mode's row: the median step time and the median of the per-round ratios (to the
    bare run of the round, or, ``--by-step``, of the run's even steps to its odd steps)."""
    row: dict[str, Any] = {"framework": framework, "mode": mode}
    for prefix, cpu in (("", False), ("cpu_", True)):
        step_times = [c.step_time(cpu) for c in runs]
        if by_step:
            ratios = [c.parity_ratio(cpu) for c in runs]
        else:
            ratios = [c.step_time(cpu) / b.step_time(cpu) for c, b in zip(runs, bare, strict=True)]
        row |= {
            f"{prefix}step_ms": median(step_times) * 1e3,
            f"{prefix}ratio": median(ratios),
            f"{prefix}ratio_per_round": ratios,
            f"{prefix}step_ms_per_round": [t * 1e3 for t in step_times],
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="transformer")
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument(
        "--by-step",
        action="store_true",
        help="callbacks act on even steps only; ratio = even-step / odd-step time of each run",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (0: torch's default); 1 makes CPU time a step's cost",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.workload = 2, 12, 3, "tiny"
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.ERROR)
    warnings.simplefilter("ignore")
    quiet()
    data = measure(args)
    rows = [
        [r["framework"], r["mode"]]
        + [round(r[key], 4) for key in ("step_ms", "ratio", "cpu_step_ms", "cpu_ratio")]
        for r in data["results"]
    ]
    ratio_name = "even / odd steps" if args.by_step else "x bare"
    header = ["framework", "mode", "step ms (median)", ratio_name, "CPU ms", f"CPU {ratio_name}"]
    print(markdown_table(header, rows))
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
