"""A deterministic 2-epoch DDP job for the torchrun restart test (CPU, gloo).

``python recovery_train.py RUN_DIR OUT [--kill-at STEP] [--no-failure-state]``: with
``--kill-at`` rank 1 SIGKILLs itself when step STEP's batch arrives, on the first attempt only
(TORCHELASTIC_RESTART_COUNT 0). torchrun restarts every rank, the guard resumes from the
newest good checkpoint (``--no-failure-state``: not from a state at the failure), and the
final weights (rank 0 writes them to OUT) must be bitwise those of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import trainguard as tg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--no-failure-state", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, generator=gen)
    dataset = TensorDataset(x, x @ torch.randn(8, 4, generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    config = tg.GuardConfig(
        run_dir=args.run_dir,
        hang_timeout=0,
        checkpoint_every=3,
        keep_checkpoints=2,
        resume=True,
        recovery=tg.RecoveryConfig(save_at_failure=not args.no_failure_state),
    )
    guard = tg.Guard(model, opt, scheduler=sched, config=config)
    with guard:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for xb, yb in guard.watch(loader, epoch=epoch):
                if rank == 1 and first_attempt and guard.state.step == args.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                loss = nn.functional.mse_loss(model(xb), yb)
                loss.backward()
                if guard.check(loss):
                    opt.step()
                    sched.step()
                opt.zero_grad(set_to_none=True)
    if rank == 0:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.save({"params": flat, "step": guard.state.step}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
