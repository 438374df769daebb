"""A 2-rank DDP job (CPU, gloo) whose data is NaN from batch position 5 on: a persistent fault.

``python hopeless_train.py RUN_DIR [--heal-on-restart]``. Every batch from position 5 on holds
a NaN sample (dataset indices 20 and up; a ``DistributedSampler`` without shuffling, 2 ranks,
batches of 2), so every rollback lands on bad data again: the escalation ladder (rollback,
+ LR backoff, + moment reset) runs out and the guard stops with NonFiniteError, recording the
stop in ``RUN_DIR/stop.json``. A restart resumes from the same checkpoint into the same data
and is refused (exit 93). ``--heal-on-restart``: on a torchrun restart the data is clean (the
cause went away; the fingerprint cannot see it: same type, same length), so a restart that is
let through (``TRAINGUARD_FORCE_RESTART=1``) finishes.

Prints one line per rank when it starts (``hopeless_train: attempt A rank R start T``), so
the test counts the attempts, and rank 0 one line when it finishes.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import trainguard as tg

BAD_FROM = 20  # dataset index: batch position 5 on both ranks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--heal-on-restart", action="store_true")
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"hopeless_train: attempt {attempt} rank {rank} start {time.time():.3f}", flush=True)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(128, 8, generator=gen)
    y = x @ torch.randn(8, 4, generator=gen)
    if not (args.heal_on_restart and attempt > 0):
        x[BAD_FROM:, 0] = float("nan")
    dataset = TensorDataset(x, y)
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = tg.GuardConfig(
        run_dir=args.run_dir,
        hang_timeout=0,
        max_consecutive=2,
        on_escalation="rollback",
        checkpoint_every=2,
        keep_checkpoints=2,
        resume=True,
        recovery=tg.RecoveryConfig(snapshot_every=2, good_after=1),
    )
    with tg.Guard(model, opt, config=config) as guard:
        for xb, yb in guard.watch(loader, epoch=0):
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"hopeless_train: finished at step {guard.state.step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
