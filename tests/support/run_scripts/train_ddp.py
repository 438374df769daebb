"""A plain training script that knows nothing of trainguard (no import of it), for the tests of
``trainguard run``. One process, or DDP (gloo) under torchrun.

    python train_ddp.py --out DIR [--steps N] [--optimizer sgd|adamw|adam|zero]
        [--nan-rank R --nan-step S]      rank R's batch at step S holds a NaN
        [--block-rank R --block-step S]  rank R's loader blocks at step S
        [--loss-nan-rank R --loss-nan-step S]  rank R's loss is multiplied by NaN after the
                                         loss function (its backward runs on the product)
        [--drop-step S]                  every rank leaves out step S (no forward, no update)
        [--second-optimizer]             a second optimizer steps too (from step 2)
        [--muon]                         one model, two optimizers: Muon over head.weight
                                         steps after the --optimizer over the rest
        [--probe-rank R]                 rank R alone trains a linear probe on the model's
                                         detached output, with an optimizer of its own
                                         (from step 2)
        [--loose-param-rank R]           rank R's optimizer also holds a parameter of no
                                         module (never given a gradient)
        [--global-step-hooks]            process-wide optimizer step hooks of the script's
                                         own (a profiler's), counting the steps
        [--clip MAX_NORM]                clip_grad_norm_ before every optimizer step
        [--grad-nan-rank R --grad-nan-step S]  rank R's head.weight gradient gets a NaN
                                         after backward at step S (before the clip)
        [--skip-nonfinite]               the script's own rule: no optimizer step when its
                                         loss is not finite (on that rank alone)
        [--own-skip-rank R --own-skip-step S]  rank R's loop leaves step S's update out
                                         itself (forward and backward done)
        [--scaler --overflow-rank R --overflow-step S]  a GradScaler (CPU) scales the loss;
                                         rank R's loss at step S overflows once scaled

Each rank saves its final weights, buffers and optimizer state to ``DIR/rank{r}.pt``, and
with ``--clip`` the norms the clip returned (``clip_norms``: step -> float).
``make_replay`` is the replay factory (the model and the script's loss of the recorded
micro-batch ``(x, y)``: the guard follows the model's output to ``F.mse_loss`` and keeps
its targets).
"""

from __future__ import annotations

import argparse
import copy
import io
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data import DataLoader, Dataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


class Points(Dataset[tuple[Tensor, Tensor]]):
    """Four samples a step; rank-specific; a NaN or a blocking read where asked."""

    def __init__(self, rank: int, steps: int, args: argparse.Namespace) -> None:
        g = torch.Generator().manual_seed(100 + rank)
        self.x = torch.randn(steps * 4, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
        if rank == args.nan_rank:
            self.x[args.nan_step * 4, 0] = float("nan")
        self.block = args.block_step * 4 if rank == args.block_rank else -1
        self.marker = args.out / f"blocked-rank{rank}"

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if i == self.block:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(str(time.time()))
            time.sleep(600)  # a stuck read (a dead filesystem, a stalled stream)
        return self.x[i], self.y[i]


class SlowFile(io.BytesIO):
    """A checkpoint file whose first write takes ``delay`` seconds (a large save)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def write(self, data: Any) -> int:
        time.sleep(self.delay)
        self.delay = 0.0
        return super().write(data)


def evaluate(module: nn.Module, seconds: float) -> None:
    """Forwards of ``module`` in eval mode for ``seconds`` (a sampler's loop)."""
    module.eval()
    end = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < end:
            module(torch.randn(4, 8))
            time.sleep(0.1)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if name == "zero":  # under torchrun: AdamW over this rank's shard, stepped inside its step
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, lr=0.01, weight_decay=0.1
        )
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def make_replay() -> tuple[nn.Module, Any]:
    """Replay factory: the model, and the script's loss of the recorded micro-batch."""
    return Net(), lambda model, batch: F.mse_loss(model(batch[0]), batch[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--nan-step", type=int, default=-1)
    parser.add_argument("--block-rank", type=int, default=-1)
    parser.add_argument("--loss-nan-rank", type=int, default=-1)
    parser.add_argument("--loss-nan-step", type=int, default=-1)
    parser.add_argument("--block-step", type=int, default=-1)
    parser.add_argument("--drop-step", type=int, default=-1)
    parser.add_argument("--second-optimizer", action="store_true")
    parser.add_argument("--muon", action="store_true")
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--grad-nan-rank", type=int, default=-1)
    parser.add_argument("--grad-nan-step", type=int, default=-1)
    parser.add_argument("--skip-nonfinite", action="store_true")
    parser.add_argument("--own-skip-rank", type=int, default=-1)
    parser.add_argument("--own-skip-step", type=int, default=-1)
    parser.add_argument("--scaler", action="store_true")
    parser.add_argument("--overflow-rank", type=int, default=-1)
    parser.add_argument("--overflow-step", type=int, default=-1)
    parser.add_argument("--save-rank", type=int, default=-1)
    parser.add_argument("--save-step", type=int, default=-1)
    parser.add_argument("--save-seconds", type=float, default=0.0)
    parser.add_argument("--eval-seconds", type=float, default=0.0)
    parser.add_argument("--renew-step", type=int, default=-1)
    parser.add_argument("--probe-rank", type=int, default=-1)
    parser.add_argument("--loose-param-rank", type=int, default=-1)
    parser.add_argument("--global-step-hooks", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hooked: dict[str, int] = {"pre": 0, "post": 0}
    if args.global_step_hooks:
        register_optimizer_step_pre_hook(lambda *_: hooked.__setitem__("pre", hooked["pre"] + 1))
        register_optimizer_step_post_hook(lambda *_: hooked.__setitem__("post", hooked["post"] + 1))
    distributed = "LOCAL_RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    net = Net()
    ema = copy.deepcopy(net)  # evaluated by one rank (--eval-seconds), never trained
    model: nn.Module = nn.parallel.DistributedDataParallel(net) if distributed else net
    params = list(model.parameters())
    if rank == args.loose_param_rank:
        params.append(nn.Parameter(torch.zeros(1)))
    muon = None
    if args.muon:  # nanochat's split: Muon over the matrices, the optimizer over the rest
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tg_optimizers import Muon

        muon = Muon([net.head.weight])
        params = [p for p in params if p is not net.head.weight]
    optimizer = make_optimizer(args.optimizer, params)
    probe = nn.Linear(1, 1) if rank == args.probe_rank else None
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=0.1) if probe is not None else None
    head = torch.optim.SGD(net.head.parameters(), lr=0.01) if args.second_optimizer else None
    loader = DataLoader(Points(rank, args.steps, args), batch_size=4)
    clip_norms: dict[int, float] = {}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if args.scaler else None
    for step, (x, y) in enumerate(loader):
        if step == args.drop_step:
            continue
        if step == args.renew_step:  # made anew mid-run (each epoch, after unfreezing)
            optimizer = make_optimizer(args.optimizer, model.parameters())
        optimizer.zero_grad()
        if muon is not None:
            muon.zero_grad()
        out = model(x)
        loss = F.mse_loss(out, y)
        if rank == args.overflow_rank and step == args.overflow_step:
            loss = loss * 1e36  # finite, and Inf once scaled
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            continue
        if rank == args.loss_nan_rank and step == args.loss_nan_step:
            loss = loss * float("nan")  # made after the loss the guard reads
        loss.backward()
        if args.skip_nonfinite and not torch.isfinite(loss):
            continue  # the script's own rule, on this rank alone
        if rank == args.own_skip_rank and step == args.own_skip_step:
            continue
        if rank == args.grad_nan_rank and step == args.grad_nan_step:
            with torch.no_grad():
                net.head.weight.grad[0, 0] = float("nan")  # type: ignore[index]
        if args.clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            clip_norms[step] = float(norm)
        optimizer.step()
        if muon is not None:
            muon.step()
        if head is not None and step >= 2:
            head.step()
        if probe is not None and probe_optimizer is not None and step >= 2:
            probe_optimizer.zero_grad()
            F.mse_loss(probe(out.detach()), y).backward()
            probe_optimizer.step()
        if step == args.save_step:  # one rank writes a checkpoint, the others wait for it
            if rank == args.save_rank:
                torch.save({"model": net.state_dict()}, SlowFile(args.save_seconds))
                evaluate(ema, args.eval_seconds)
            if distributed:
                dist.barrier()
    args.out.mkdir(parents=True, exist_ok=True)
    held = getattr(optimizer, "optim", optimizer)  # ZeRO: this rank's shard optimizer
    state = {"model": net.state_dict(), "optimizer": held.state_dict()}
    if scaler is not None:
        state["scale"] = scaler.get_scale()
    state["clip_norms"] = clip_norms
    state["hooked"] = hooked
    if muon is not None:
        state["muon"] = muon.state_dict()
    torch.save(state, args.out / f"rank{rank}.pt")
    print(f"rank {rank}: trained {args.steps} steps, last loss {loss.item():.4f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
