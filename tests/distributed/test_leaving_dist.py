"""A rank that stops guarding says so in its row: every rank stops at the same step.

``trainguard run`` may find on one rank only a loop it cannot guard (a probe's optimizer of
rank 0's own). That rank's next check carries the ``leaving`` column
(``Guard.internals.check_leaving``); every rank reads ``leaving_ranks`` from that step's
agreement, and nowhere else. The check is otherwise the usual one: a NaN on another rank at
that step is skipped on every rank.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import run_ranks, values
from tg_models import TinyNet
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg

LEAVE_STEP = 3
STEPS = 6


def _train(rank: int, world: int, run_dir: str, leaver: int, nan_rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0)
    gen = torch.Generator().manual_seed(rank)
    seen: list[list[int]] = []
    applied: list[bool] = []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=gen)
        if rank == nan_rank and step == LEAVE_STEP:
            x[0, 0] = math.nan
        loss = model(x).pow(2).mean()
        loss.backward()
        if rank == leaver and step == LEAVE_STEP:
            ok = guard.internals.check_leaving(loss)
        else:
            ok = guard.check(loss)
        applied.append(ok)
        if ok:
            opt.step()
        opt.zero_grad()
        seen.append(list(guard.state.leaving_ranks))
    guard.close()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"seen": seen, "applied": applied, "params": params}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_learns_the_leaving_rank_at_the_same_step(world: int, tmp_path: Path) -> None:
    leaver, nan_rank = world - 1, 0
    ranks = values(run_ranks(_train, world, str(tmp_path), leaver, nan_rank, timeout=100))
    expected = [[] if step < LEAVE_STEP else [leaver] for step in range(STEPS)]
    for result in ranks:
        assert result["seen"] == expected
        # the leaving step is checked as any other: rank 0's NaN skips it on every rank
        assert result["applied"] == [step != LEAVE_STEP for step in range(STEPS)]
        assert torch.equal(result["params"], ranks[0]["params"])
