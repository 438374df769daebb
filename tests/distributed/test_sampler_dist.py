"""Sampler pitfalls across real processes (gloo). A two-epoch DDP run without ``set_epoch``
warns on every rank at the start of the second epoch (same step, same epoch); with
``set_epoch``, no rank warns. Loaders of different lengths are reported on every rank before
the first step, with the same counts, and the run still ends together. Parameters are
identical on every rank after each run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import run_ranks, values
from tg_models import TinyNet
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

import trainguard as tg

SAMPLES = 16
BATCH = 2
STEPS_PER_EPOCH = SAMPLES // 2 // BATCH  # two ranks


class Indexed(Dataset[dict[str, Any]]):
    """Random features with each sample's dataset index (to see the order each epoch)."""

    def __init__(self) -> None:
        self.x = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "index": i}


def _two_epochs(rank: int, run_dir: Path, set_epoch: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler: DistributedSampler[dict[str, Any]] = DistributedSampler(Indexed(), seed=3)
    loader = DataLoader(Indexed(), batch_size=BATCH, sampler=sampler)
    orders: list[list[int]] = []
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0) as guard:
        for epoch in range(2):
            if set_epoch:
                sampler.set_epoch(epoch)
            orders.append([])
            for batch in guard.watch(loader):
                orders[-1].extend(int(i) for i in batch["index"])
                loss = model(batch["x"]).pow(2).mean()
                loss.backward()
                guard.step(loss)
        steps = guard.state.step
    events = [e for e in tg.read_events(run_dir, rank) if e["kind"] == "sampler_epoch"]
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"events": events, "orders": orders, "steps": steps, "params": params}


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    return {
        "forgot": _two_epochs(rank, Path(root) / "forgot", set_epoch=False),
        "ok": _two_epochs(rank, Path(root) / "ok", set_epoch=True),
    }


@pytest.mark.timeout(90)
def test_forgotten_set_epoch_warns_on_every_rank_at_the_second_epoch(tmp_path: Path) -> None:
    ranks = values(run_ranks(_job, 2, str(tmp_path), timeout=80))
    forgot = [r["forgot"] for r in ranks]
    # The pitfall itself: without set_epoch each rank sees the same order in both epochs.
    assert all(r["orders"][0] == r["orders"][1] for r in forgot)
    for r in forgot:
        [event] = r["events"]
        assert (event["step"], event["epoch"]) == (STEPS_PER_EPOCH, 0)
    assert forgot[0]["events"][0]["step"] == forgot[1]["events"][0]["step"]  # same step

    ok = [r["ok"] for r in ranks]
    assert all(r["events"] == [] for r in ok)  # set_epoch: no rank warns
    assert all(r["orders"][0] != r["orders"][1] for r in ok)  # and the order changes
    for run in (forgot, ok):
        assert [r["steps"] for r in run] == [2 * STEPS_PER_EPOCH] * 2
        assert torch.equal(run[0]["params"], run[1]["params"])


class Shard(Sampler[int]):
    """A sampler that gives rank 1 fewer samples than rank 0 (a hand-rolled sharding)."""

    def __init__(self, rank: int) -> None:
        self.indices = list(range(rank, SAMPLES, 2))[: 8 - 3 * rank]  # 8 and 5 samples

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _uneven(rank: int, world: int, root: str, sync_free: bool) -> dict[str, Any]:
    run_dir = Path(root) / ("fused" if sync_free else "check")
    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=sync_free)
    loader = DataLoader(Indexed(), batch_size=BATCH, sampler=Shard(rank))  # 4 and 3 batches
    first_step_events: list[str] = []
    steps = 0
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0) as guard:
        for batch in guard.watch(loader):
            if steps == 0:
                first_step_events = [e["kind"] for e in tg.read_events(run_dir, rank)]
            loss = model(batch["x"]).pow(2).mean()
            loss.backward()
            if sync_free:
                guard.step(loss)
            else:
                guard.check(loss)
                opt.step()
                opt.zero_grad()
            steps += 1
    events = tg.read_events(run_dir, rank)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "first_step_events": first_step_events,
        "start": [e for e in events if e["kind"] == "uneven_lengths"],
        "end": [e for e in events if e["kind"] == "uneven_data"],
        "steps": steps,
        "params": params,
    }


def _uneven_job(rank: int, world: int, root: str) -> dict[str, Any]:
    return {
        "check": _uneven(rank, world, root, sync_free=False),
        "fused": _uneven(rank, world, root, sync_free=True),
    }


@pytest.mark.timeout(90)
def test_uneven_loader_lengths_are_reported_at_the_start_on_every_rank(tmp_path: Path) -> None:
    ranks = values(run_ranks(_uneven_job, 2, str(tmp_path), timeout=80))
    for name in ("check", "fused"):
        runs = [r[name] for r in ranks]
        for run in runs:
            assert "uneven_lengths" in run["first_step_events"], name  # before step 1
            [start] = run["start"]
            assert start["step"] == 0 and start["lengths"] == [4, 3], name
            assert start["shortest_ranks"] == [1] and start["steps_at_most"] == 3, name
            [end] = run["end"]
            assert end["steps"] == 3 and end["exhausted_ranks"] == [1], name
        assert runs[0]["start"][0]["lengths"] == runs[1]["start"][0]["lengths"]
        assert [r["steps"] for r in runs] == [3, 3], name  # ended together, no hang
        assert torch.equal(runs[0]["params"], runs[1]["params"]), name
