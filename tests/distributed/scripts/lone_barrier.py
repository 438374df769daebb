"""The classic collective mismatch, as a user's script: every 15 steps rank 0 alone saves a
checkpoint and calls ``dist.barrier()``, while the other ranks go on into the next step's
DDP gradient all-reduce. Without trainguard every rank waits until gloo's timeout (30 min);
with it, the watchdog names rank 0 and both lines within seconds (docs/hangs.md,
"Collective mismatch").

    torchrun --nproc-per-node=4 tests/distributed/scripts/lone_barrier.py RUN_DIR [--timeout 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))

from tg_models import TinyNet, loss_fn, make_batches

import trainguard as tg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = tg.Guard(model, optimizer, run_dir=args.run_dir, hang_timeout=args.timeout)
    for batch in guard.watch(make_batches(100, seed=rank)):
        loss = loss_fn(model, batch)
        loss.backward()
        guard.step(loss)
        if rank == 0 and guard.state.step % 15 == 0:
            torch.save(model.module.state_dict(), args.run_dir / "checkpoint.pt")
            dist.barrier()
    guard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
