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


def _attempt(rank: int, run_dir: str, restart_count: str, steps: int) -> str:
    """One guarded DDP run of ``steps`` steps as torchrun's attempt ``restart_count`` (this
    rank's ``TORCHELASTIC_RESTART_COUNT``); the watchdog's store prefix it used."""
    from trainguard.hang import keys

    os.environ["TORCHELASTIC_RESTART_COUNT"] = restart_count
    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0) as guard:
        for batch in guard.watch(make_batches(steps, seed=rank)):
            loss = loss_fn(model, batch)
            loss.backward()
            guard.step(loss)
        return keys.store_prefix(0)


def _job(rank: int, world: int, run_dir: str) -> list[str]:
    """Three guards in turn in one run dir: a run, the same run restarted by torchrun, and a
    new run; every event's run id, per guard."""
    ids = []
    for restart in ("0", "1", "0"):
        _attempt(rank, run_dir, restart, steps=3)
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


def _restarted_on_one_node(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """A first attempt, then a restart that only rank 1's node counted (torchrun counts
    restarts per node: the other node's workers restart with their count unchanged)."""
    seen: dict[str, Any] = {}
    for attempt, count in enumerate(("0", "1" if rank == 1 else "0")):
        seen[f"prefix{attempt}"] = _attempt(rank, run_dir, count, steps=2)
    seen["starts"] = [
        (e["run"], e["run_origin"]) for e in read_events(run_dir, rank) if e["kind"] == "start"
    ]
    return seen


@pytest.mark.timeout(60)
def test_a_restart_counted_on_one_node_is_a_restart_on_every_rank(tmp_path: Path) -> None:
    """The ranks agree on the attempt (the highest count): the same watchdog keys (a hang
    is judged from one set of heartbeats, not two) and the same run, continued."""
    ranks: list[Any] = values(run_ranks(_restarted_on_one_node, 2, str(tmp_path), timeout=50))
    assert ranks[0]["prefix1"] == ranks[1]["prefix1"]
    assert ranks[0]["prefix1"].endswith("attempt1/0")
    assert ranks[0]["starts"] == ranks[1]["starts"]
    (first, new), (again, restart) = ranks[0]["starts"]
    assert (new, restart) == ("new", "restart") and again == first
