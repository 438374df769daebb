"""A run's id is rank 0's decision, the same on every rank (2 gloo processes, spawn)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import run_ranks, values
from tg_models import TinyNet, loss_fn, make_batches
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from trainguard.events import read_events


def _job(rank: int, world: int, run_dir: str) -> list[str]:
    """Three guards in turn in one run dir: a run, the same run restarted by torchrun, and a
    new run; every event's run id, per guard."""
    ids = []
    for restart in ("0", "1", "0"):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = restart
        torch.manual_seed(0)
        model = DDP(TinyNet())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0) as guard:
            for batch in guard.watch(make_batches(3, seed=rank)):
                loss = loss_fn(model, batch)
                loss.backward()
                guard.step(loss)
        runs = {e["run"] for e in read_events(run_dir, rank=rank)} - set(ids)
        ids.append(runs.pop() if runs else ids[-1])
        assert not runs, f"rank {rank}: one guard wrote several run ids"
    return ids


@pytest.mark.timeout(60)
def test_every_rank_writes_rank_0s_run_id(tmp_path: Path) -> None:
    ranks: list[Any] = values(run_ranks(_job, 2, str(tmp_path), timeout=50))
    assert ranks[0] == ranks[1]  # the same ids on both ranks
    first, restarted, new = ranks[0]
    assert first == restarted != new
    starts = [e for e in read_events(tmp_path) if e["kind"] == "start"]
    assert [(e["rank"], e["run"]) for e in starts if e["rank"] == 1] == [
        (1, first),
        (1, first),
        (1, new),
    ]
