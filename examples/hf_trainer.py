"""A Hugging Face Trainer on a tiny GPT-2 (built from a config, no download) where one batch
has every label masked (-100): its mean loss is 0/0 = NaN.

    python examples/hf_trainer.py --run-dir runs/hf
    torchrun --nproc-per-node=2 examples/hf_trainer.py --run-dir runs/hf   # 2 CPU processes
    trainguard replay runs/hf/captures/step-* --factory examples/hf_trainer.py:make_replay

``TrainGuardMixin`` hands each micro-batch and its loss to ``TrainGuardCallback``, which
checks the step before the Trainer clips, skips it on every rank and writes a bundle; the
run goes on. ``--out DIR`` writes each rank's weights digest and guard counters (tests).

Note ``average_tokens_across_devices=False``: with the default (True) the loss of a rank is
its token sum over the tokens of every rank, so one rank's fully masked batch gives 0, not
NaN (nothing goes wrong then: that batch just contributes no gradient).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from trainguard.integrations.transformers import TrainGuardCallback, TrainGuardMixin, replay_spec

SAMPLES = 16
MASKED = 5
"""The sample whose labels are all -100 (batches of one sample: that batch)."""


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Made-up token sequences; labels = input_ids (causal LM), sample MASKED fully masked."""

    def __init__(self, n: int = SAMPLES, masked: int | None = MASKED) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)
        self.masked = masked

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        if i == self.masked:
            labels[:] = -100
        return {"input_ids": self.ids[i], "labels": labels}


class GuardedTrainer(TrainGuardMixin, Trainer):
    """The Trainer with the mixin that shows the guard the loss and the batches."""


def make_replay() -> Any:
    """The replay factory: the model of the run (weights come from the bundle)."""
    return replay_spec(tiny_gpt2())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", default="runs/hf")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    torch.manual_seed(0)
    model = tiny_gpt2()
    guard = TrainGuardCallback(run_dir=args.run_dir, hang_timeout=120)
    training = TrainingArguments(
        output_dir=str(Path(args.run_dir) / "trainer"),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=args.accumulate,
        num_train_epochs=1,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo" if "LOCAL_RANK" in os.environ else None,  # torchrun on CPU
        average_tokens_across_devices=False,
        disable_tqdm=True,
        seed=0,
    )
    trainer = GuardedTrainer(model=model, args=training, train_dataset=Tokens(), callbacks=[guard])
    trainer.train()
    state = guard.final_state["state"] if guard.final_state else {}
    rank = training.process_index
    if rank == 0:
        print(
            f"trained {trainer.state.global_step} steps on {training.world_size} process(es); "
            f"non-finite steps skipped: {state.get('nonfinite_steps')}; bundles: "
            f"{sorted(str(p) for p in Path(args.run_dir, 'captures').glob('step-*'))}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        weights = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        result = {
            "rank": rank,
            "global_step": trainer.state.global_step,
            "state": state,
            "weights_sha256": hashlib.sha256(weights).hexdigest(),
            "weights_finite": finite,
        }
        (args.out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
