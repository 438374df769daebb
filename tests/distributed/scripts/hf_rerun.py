"""``TrainGuardCallback(rerun=True)`` under ``torchrun --nproc-per-node=2`` (gloo on CPU).

Each process trains the tiny GPT-2 of ``examples/hf_trainer.py`` (dropout on) twice in the
same process group, two micro-batches a step: ``clean``, and ``fault`` where a forward hook
on rank 1 poisons one output once, in step ``FAULT_STEP``'s first micro-batch (a transient
fault). In both runs a hook on rank 0 poisons every forward of step ``BAD_STEP``, the
rerun's too (a persistent fault). ``--out DIR`` gets ``rank{r}.json``: each run's weights
digest and the guard's counters.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from fast_exit import exit_without_finalizing
from torch import Tensor, nn
from transformers import TrainingArguments

from trainguard.integrations.transformers import TrainGuardCallback

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hf_trainer.py"
FAULT_STEP = 1
BAD_STEP = 3


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("tg_hf_example_rerun_dist", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Poison:
    """Poisons ``module``'s output on ``rank`` in ``step``: its first forward (``once``) or
    every one."""

    def __init__(self, module: nn.Module, callback: TrainGuardCallback, *where: Any) -> None:
        self.callback, self.done = callback, False
        self.rank, self.step, self.once = where
        module.register_forward_hook(self)

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        guard = self.callback.guard
        if self.done or guard is None or (guard.rank, guard.state.step) != (self.rank, self.step):
            return None
        self.done = self.once
        return output * float("nan")


def train(ex: Any, run_dir: Path, fault: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ex.tiny_gpt2()
    callback = TrainGuardCallback(run_dir=run_dir, hang_timeout=0, capture=False, rerun=True)
    Poison(model.transformer.h[0].mlp, callback, 0, BAD_STEP, False)
    if fault:
        Poison(model.transformer.h[0].mlp, callback, 1, FAULT_STEP, True)
    args = TrainingArguments(
        output_dir=str(run_dir / "trainer"),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-2,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
        seed=0,
    )
    trainer = ex.GuardedTrainer(
        model=model, args=args, train_dataset=ex.Tokens(masked=None), callbacks=[callback]
    )
    trainer.train()
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    assert callback.final_state is not None
    return {
        "global_step": trainer.state.global_step,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
        "state": callback.final_state["state"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.simplefilter("ignore")
    ex = _example()
    result = {run: train(ex, args.run_dir / run, run == "fault") for run in ("clean", "fault")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    exit_without_finalizing()  # before PyTorch's exit race: fast_exit.py says why


if __name__ == "__main__":
    main()
