"""A non-finite learning rate on one rank only (its own scheduler state gone wrong) is a bad
step on every rank, decided before the update: the same decision everywhere, the replicas
identical, the event naming the rank and (on that rank) the param group (issue 55)."""

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

BAD_STEP = 4


def _train(rank: int, world: int, root: str, fused: bool) -> dict[str, Any]:
    run_dir = Path(root) / ("fused" if fused else "check")
    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randn(6, 8, generator=gen) for _ in range(8)]
    oks = []
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0) as guard:
        for x in guard.watch(data):
            bad = rank == 1 and guard.global_step == BAD_STEP
            opt.param_groups[0]["lr"] = math.inf if bad else 1e-3
            loss = model(x).pow(2).mean()
            loss.backward()
            if fused:
                oks.append(bool(guard.step(loss)))
            else:
                oks.append(guard.check(loss))
                opt.step()
                opt.zero_grad()
    events = [e for e in tg.read_events(run_dir, rank) if e["kind"] == "nonfinite"]
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"oks": oks, "events": events, "params": params}


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    return {fused: _train(rank, world, root, fused) for fused in (False, True)}


@pytest.mark.timeout(120)
def test_one_ranks_nan_learning_rate_is_every_ranks_bad_step(tmp_path: Path) -> None:
    ranks = values(run_ranks(_job, 2, str(tmp_path), timeout=100))
    for fused in (False, True):
        r0, r1 = ranks[0][fused], ranks[1][fused]
        expected = [step != BAD_STEP for step in range(8)]
        assert r0["oks"] == r1["oks"] == expected, fused
        assert torch.equal(r0["params"], r1["params"]), fused  # no rank stepped apart
        assert torch.isfinite(r0["params"]).all(), fused
        for run in (r0, r1):
            (event,) = run["events"]
            assert (event["step"], event["where"], event["ranks"]) == (
                BAD_STEP,
                "hyperparameter",
                [1],
            ), fused
        assert r1["events"][0]["hyperparameters"] == [{"group": 0, "name": "lr", "value": "inf"}]
        assert "hyperparameters" not in r0["events"][0]  # rank 0's own are finite
