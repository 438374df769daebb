"""The hand-written loop's API across real processes (gloo, 2 ranks; issue 26).

- ``check(loss.item())`` with a NaN on one rank: every rank skips the same step.
- DDP with an unused parameter and FSDP2 shards: no ``check_without_gradients`` warning on
  good steps; ``check()`` before ``backward()``: one warning on each rank, same decisions.
- A hand-written LR schedule after a rollback (the bad batch on one rank only): every rank
  has the same ``global_step`` and ``lr_factor``, and the LR its update used is
  ``get_lr(global_step) * lr_factor``, once.

One spawned job runs every scenario, so the start-up is paid once.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import cpu_fully_shard, run_ranks, values
from tg_models import TinyNet, loss_fn, make_batches
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from trainguard.events import read_events


class _WithUnused(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(8, 4)  # never in the forward: its gradient stays None


def _guard(model: nn.Module, run_dir: Path, **options: Any) -> tg.Guard:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return tg.Guard(model, opt, config=tg.GuardConfig(run_dir=run_dir, hang_timeout=0, **options))


def _no_grad_events(run_dir: Path, rank: int) -> list[int]:
    return [e["step"] for e in read_events(run_dir, rank) if e["kind"] == "check_without_gradients"]


def _float_losses(rank: int, model: nn.Module, run_dir: Path, bad_rank: int) -> list[bool]:
    """``check(loss.item())``; step 1's loss is NaN on ``bad_rank`` only."""
    guard = _guard(model, run_dir)
    results = []
    for batch in guard.watch(make_batches(4, seed=rank)):
        loss = loss_fn(model, batch)
        loss.backward()
        value = loss.item()
        if guard.global_step == 1 and rank == bad_rank:
            value = float("nan")
        results.append(guard.check(value))
        guard.optimizer.step()
        guard.optimizer.zero_grad()
    guard.close()
    return results


def _check_first(rank: int, run_dir: Path) -> list[bool]:
    """``check()`` before ``backward()`` on every step (the mistake)."""
    torch.manual_seed(0)
    model = DDP(_WithUnused(), find_unused_parameters=True)
    guard = _guard(model, run_dir)
    results = []
    for batch in guard.watch(make_batches(3, seed=rank)):
        loss = loss_fn(model, batch)
        results.append(guard.check(loss))
        loss.backward()
        guard.optimizer.step()
        guard.optimizer.zero_grad(set_to_none=True)
    guard.close()
    return results


def get_lr(it: int) -> float:
    return 0.02 * min(1.0, (it + 1) / 5) / (1.0 + 0.1 * it)


def _schedule_after_rollback(rank: int, run_dir: Path) -> list[tuple[int, float, float]]:
    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    config = tg.GuardConfig(
        run_dir=run_dir,
        hang_timeout=0,
        on_escalation="rollback",
        max_consecutive=1,
        on_spike="off",
        recovery=tg.RecoveryConfig(
            snapshot_every=2, good_after=1, lr_backoff=0.5, lr_backoff_steps=50
        ),
    )
    guard = tg.Guard(model, opt, config=config)
    used: list[float] = []  # registered after the guard's hooks: sees the LR the update uses
    opt.register_step_pre_hook(lambda o, a, k: used.append(float(o.param_groups[0]["lr"])))
    data: list[Tensor] = make_batches(16, seed=3 + rank)
    if rank == 1:  # the bad batches on one rank only
        data[5] = data[5] * float("nan")
        data[8] = data[8] * float("nan")
    rows = []
    for batch in guard.watch(data):
        it = guard.global_step
        for group in opt.param_groups:
            group["lr"] = get_lr(it)
        factor = guard.lr_factor
        loss = loss_fn(model, batch)
        loss.backward()
        if guard.check(loss):
            opt.step()
            assert used[-1] == get_lr(it) * factor, (it, used[-1], factor)
            rows.append((it, used[-1], factor))
        opt.zero_grad(set_to_none=True)
    guard.close()
    return rows


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    ddp = DDP(_WithUnused(), find_unused_parameters=True)
    out["ddp"] = _float_losses(rank, ddp, base / "ddp", bad_rank=1)
    out["ddp_warned"] = _no_grad_events(base / "ddp", rank)
    torch.manual_seed(0)
    sharded = TinyNet()
    cpu_fully_shard(sharded.encoder, sharded)
    out["fsdp"] = _float_losses(rank, sharded, base / "fsdp", bad_rank=0)
    out["fsdp_warned"] = _no_grad_events(base / "fsdp", rank)
    out["check_first"] = _check_first(rank, base / "first")
    out["first_warned"] = _no_grad_events(base / "first", rank)
    out["schedule"] = _schedule_after_rollback(rank, base / "lr")
    return out


@pytest.mark.timeout(90)
def test_loop_api_two_ranks(tmp_path: Path) -> None:
    runs = values(run_ranks(_job, 2, str(tmp_path), timeout=80))
    for run in runs:
        assert run["ddp"] == [True, False, True, True]  # rank 1's NaN float: both skip
        assert run["fsdp"] == [True, False, True, True]  # rank 0's, under FSDP2
        assert run["ddp_warned"] == [] and run["fsdp_warned"] == []  # grads present
        assert run["check_first"] == [True, True, True]
        assert run["first_warned"] == [0]  # once, on each rank
    assert runs[0]["schedule"] == runs[1]["schedule"]  # same steps, LRs and factors
    factors = [f for _, _, f in runs[0]["schedule"]]
    assert 0.5 in factors and factors[-1] < 1.0
