"""guard.metrics() and the guard's events in TensorBoard (pip install 'trainguard[tensorboard]').

    python examples/tensorboard_metrics.py --run-dir runs/tb
    tensorboard --logdir runs/tb/tensorboard

A short regression loop; batch 5 holds a NaN, so step 5 is skipped. Every step writes the
guard's numbers as scalars (trainguard/skipped_steps, trainguard/loss, ...) next to the
loop's own loss; the skip (and the non-finite event before it) lands as text under
trainguard/events at step 5, at once.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn

import trainguard as tg
from trainguard.integrations.tensorboard import TensorBoardLogger, summary_writer

POISONED = 5


def train(run_dir: Path, steps: int = 12) -> tg.Guard:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 8, generator=gen) for _ in range(steps)]
    batches[POISONED][3, 0] = math.nan

    writer = summary_writer(run_dir / "tensorboard")  # shared with the loop's own scalars
    guard = tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=0)
    tb = TensorBoardLogger(guard, writer)
    with guard:
        for step, x in enumerate(guard.watch(batches)):
            loss = (model(x) - x.sum(1, keepdim=True).sin()).pow(2).mean()
            loss.backward()
            if guard.check(loss):
                optimizer.step()
            optimizer.zero_grad()
            writer.add_scalar("train/loss", loss.item(), step)
            tb.log(step)
    tb.close()  # after the guard: a sync-free step's last events come at the guard's close
    writer.close()
    return guard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=Path("runs/tensorboard_metrics"))
    args = parser.parse_args()
    guard = train(args.run_dir)
    metrics = guard.metrics()
    skipped = list(guard.state.nonfinite_steps)
    print(f"trained {metrics['trainguard/step']} steps, skipped steps: {skipped}")
    print("last metrics:", {k: round(v, 4) for k, v in metrics.items()})
    print(f"tensorboard --logdir {args.run_dir / 'tensorboard'}")


if __name__ == "__main__":
    main()
