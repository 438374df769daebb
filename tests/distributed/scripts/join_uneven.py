"""Uneven inputs the PyTorch way: DDP's ``Join`` (rank 0 has 8 batches, rank 1 has 5).

    torchrun --nproc-per-node=2 join_uneven.py OUT --mode plain|guard|watch [--run-dir R]

- ``plain``: no trainguard (what ``trainguard run`` gets);
- ``guard``: a ``tg.Guard`` checks each step of the plain loop: it must refuse the ``Join``
  on every rank before its first all-reduce (``step/join.py``);
- ``watch``: the same fed through ``guard.watch()``: every rank stops at the shortest data.

Each rank saves its parameters to ``OUT/rank<r>.pt`` and prints ``STEPS <n>``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", choices=["plain", "guard", "watch"], default="plain")
    parser.add_argument("--run-dir", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(16, 6, generator=gen) for _ in range(8 if rank == 0 else 5)]
    steps = 0
    with Join([model]):
        if args.mode == "plain":
            for x in batches:
                model(x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
        else:
            import trainguard as tg

            with tg.Guard(model, optimizer, run_dir=args.run_dir) as guard:
                feed = guard.watch(batches) if args.mode == "watch" else batches
                for x in feed:
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    if guard.check(loss):
                        optimizer.step()
                    optimizer.zero_grad()
                    steps += 1
    print(f"rank {rank} STEPS {steps}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(model.module.state_dict(), args.out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
