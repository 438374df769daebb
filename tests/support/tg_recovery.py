"""A small regression job for the recovery tests: one poisoned batch, DDP or FSDP2 on gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tg_models import TinyNet
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from trainguard.events import read_events

W_TRUE = torch.Generator().manual_seed(7)


def make_data(rank: int, n: int, poison: dict[int, float]) -> list[tuple[Tensor, Tensor, float]]:
    """``n`` batches (x, y, corrupt); batch ``i`` in ``poison`` either corrupts the update
    (a huge finite value written into every gradient after the check, as a bad kernel or an
    overflowing optimizer would: the weights are ruined, every later loss is Inf) or, for
    ``nan``, feeds NaN inputs (bad at any weights)."""
    gen = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    out = []
    for i in range(n):
        x = torch.randn(6, 8, generator=gen)
        scale = poison.get(i, 1.0)
        if scale != scale:  # NaN: a batch that is bad at any weights
            x = x * float("nan")
            scale = 1.0
        out.append((x, x @ w, scale))
    return out


def wrap(model: TinyNet, mode: str) -> nn.Module:
    if mode == "plain":
        return model
    if mode == "ddp":
        return DDP(model)
    fully_shard(model.encoder)
    fully_shard(model.head)
    fully_shard(model)
    return model


def full_params(model: nn.Module) -> Tensor:
    parts = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(full.detach().reshape(-1))
    return torch.cat(parts)


def eval_loss(model: nn.Module) -> float:
    data = make_data(99, 4, {})
    with torch.no_grad():
        losses = [nn.functional.mse_loss(model(x), y) for x, y, _ in data]
    return float(torch.stack(losses).mean())


def train(
    rank: int, mode: str, run_dir: Path, batches: int, poison: dict[int, float], **guard_kwargs: Any
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = wrap(TinyNet(), mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    guard = tg.Guard(model, opt, run_dir=run_dir, scheduler=sched, hang_timeout=0, **guard_kwargs)
    out: dict[str, Any] = {"error": None}
    try:
        with guard:
            for x, y, scale in guard.watch(make_data(rank, batches, poison)):
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                if guard.check(loss):
                    if scale != 1.0:
                        for p in model.parameters():
                            p.grad.fill_(scale)  # type: ignore[union-attr]
                    opt.step()
                    sched.step()
                opt.zero_grad(set_to_none=True)
    except tg.NonFiniteError as exc:
        out["error"] = type(exc).__name__
    params = full_params(model)
    gathered = [params]
    if dist.is_initialized():
        gathered = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, params)
    out.update(
        step=guard.state.step,
        finite=bool(torch.isfinite(params).all()),
        same=all(torch.equal(gathered[0], g) for g in gathered),
        eval_loss=eval_loss(model),
        events=[e for e in read_events(run_dir, rank) if e["kind"] in RECOVERY_EVENTS],
    )
    return out


RECOVERY_EVENTS = {
    "checkpoint_damaged",
    "checkpoint_good",
    "rollback",
    "rollback_refused",
    "escalate",
    "loss_mismatch",
    "resume",
    "checkpoint",
}
