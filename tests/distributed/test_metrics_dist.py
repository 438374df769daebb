"""``guard.metrics()`` on 2 ranks (DDP, gloo): the same dict on every rank, no collective.

Collectives issued from Python are counted by wrapping torch.distributed's functions, as in
test_step_budget.py (DDP's own gradient all-reduces run in its C++ reducer: not ours).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import count_collectives, run_ranks, values
from tg_models import TinyNet
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg

STEPS = 6
BAD = 2  # rank 1's batch of step 2 holds a NaN


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(10 + rank)
    batches = [torch.randn(6, 8, generator=gen) for _ in range(STEPS)]
    if rank == 1:
        batches[BAD][0, 0] = math.nan
    calls: list[tuple[str, int]] = []
    count_collectives(calls)
    guard = tg.Guard(model, opt, run_dir=Path(root), hang_timeout=0, capture=False)
    seen, in_check, in_metrics = [], [], []
    for x in guard.watch(batches):
        loss = (model(x) - 1.0).pow(2).mean()
        loss.backward()
        before = len(calls)
        if guard.check(loss):
            opt.step()
        opt.zero_grad()
        in_check.append(len(calls) - before)
        before = len(calls)
        seen.append(guard.metrics())
        in_metrics.append(len(calls) - before)
    guard.close()
    return {"seen": seen, "in_check": in_check, "in_metrics": in_metrics}


def _same(a: float | int, b: float | int) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.timeout(60)
def test_every_rank_gets_the_same_metrics_without_a_collective(tmp_path: Path) -> None:
    runs = values(run_ranks(_job, 2, str(tmp_path), timeout=50))
    for run in runs:
        assert run["in_metrics"] == [0] * STEPS  # metrics() issues no collective
        assert run["in_check"] == [1] * STEPS  # check() its one all-reduce, as before
    zero, one = runs[0]["seen"], runs[1]["seen"]
    for step in range(STEPS):
        assert set(zero[step]) == set(one[step])
        for key in zero[step]:
            assert _same(zero[step][key], one[step][key]), (step, key)
    assert [m["trainguard/skipped_steps"] for m in zero] == [0, 0, 1, 1, 1, 1]
    assert math.isnan(zero[BAD]["trainguard/loss"])  # the mean over the ranks: rank 1's NaN
    assert math.isfinite(zero[-1]["trainguard/loss"])


def _stalled_job(rank: int, world: int, root: str) -> list[int]:
    """Five steps, then a long pause without a step (an evaluation that calls no forward, a
    wait): what rank 0's metrics log holds by then, before the guard closes."""
    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = tg.Guard(model, opt, run_dir=Path(root), hang_timeout=30, capture=False)
    for x in guard.watch([torch.randn(6, 8) for _ in range(5)]):
        loss = (model(x) - 1.0).pow(2).mean()
        loss.backward()
        if guard.check(loss):
            opt.step()
        opt.zero_grad()
    time.sleep(2.5)  # the watchdog ticks; a kill now must not cost the buffered lines
    path = Path(root) / "metrics" / "rank-0.jsonl"
    steps = (
        [json.loads(line)["step"] for line in path.read_text().splitlines()] if rank == 0 else []
    )
    guard.close()
    return steps


@pytest.mark.timeout(90)
def test_the_watchdog_writes_the_lines_of_a_stalled_loop(tmp_path: Path) -> None:
    """A loop that stops stepping (then is killed) used to leave its last lines in the buffer:
    the hang watchdog's thread writes them a second after they wait (issue 53, item 10)."""
    steps = values(run_ranks(_stalled_job, 2, str(tmp_path), timeout=80))
    assert steps[0] == [0, 1, 2, 3, 4]
