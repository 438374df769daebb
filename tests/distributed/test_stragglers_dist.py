"""Stragglers on real processes: 4-rank DDP over gloo on CPU, one spawn for every scenario.

One rank's loader 40 ms slower per batch, then one rank's forward 40 ms slower (a tiny
model), then 200 healthy steps of a wider model whose forward takes about 10-20 ms, where
both floors of the rule meet (1.5 x 20 ms is 10 ms lost): the slow rank is named in the
right phase within 80 steps and no other rank is; the healthy run raises no ``straggler``
event (four processes on two shared cores are a noisy cluster); ``trainguard report``
names the straggler."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import run_ranks, values
from tg_models import TinyNet, loss_fn, make_batches
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from trainguard.events import read_events

WORLD = 4
DELAY = 0.04
SLOW_STEPS = 80
HEALTHY_STEPS = 200
SCENARIOS = {  # name: (slow rank, phase made slow, steps, width)
    "data": (2, "data", SLOW_STEPS, 0),
    "compute": (1, "compute", SLOW_STEPS, 0),
    "healthy": (None, None, HEALTHY_STEPS, 512),
}


class SlowNet(TinyNet):
    """TinyNet (``width``: in, 2 x width hidden, out) whose forward sleeps ``delay`` seconds."""

    def __init__(self, delay: float, width: int) -> None:
        super().__init__(*((width, 2 * width, width) if width else ()))
        self.delay = delay

    def forward(self, x: Tensor) -> Tensor:
        if self.delay:
            time.sleep(self.delay)
        return super().forward(x)


def _loader(rank: int, steps: int, delay: float, width: int) -> Iterator[Tensor]:
    shape = {"batch": 128, "d_in": width} if width else {}
    for batch in make_batches(steps, seed=rank, **shape):
        if delay:
            time.sleep(delay)  # a slow disk or decoder on this rank
        yield batch


def _scenario(rank: int, run_dir: Path, name: str) -> None:
    slow_rank, phase, steps, width = SCENARIOS[name]
    slow = rank == slow_rank
    torch.manual_seed(0)
    model = SlowNet(DELAY if slow and phase == "compute" else 0.0, width)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    with tg.Guard(ddp, opt, run_dir=run_dir / name, hang_timeout=0) as guard:
        delay = DELAY if slow and phase == "data" else 0.0
        for batch in guard.watch(_loader(rank, steps, delay, width)):
            loss = loss_fn(ddp, batch)
            loss.backward()
            guard.step(loss)


def _job(rank: int, world: int, run_dir: str) -> None:
    for name in SCENARIOS:
        _scenario(rank, Path(run_dir), name)


def _stragglers(run_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir, rank=rank) if e["kind"] == "straggler"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stragglers")
    values(run_ranks(_job, WORLD, str(root), timeout=100))
    return root


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["data", "compute"])
def test_the_slow_rank_is_named_in_its_phase(runs: Path, name: str) -> None:
    slow_rank, phase, _, _ = SCENARIOS[name]
    events = _stragglers(runs / name)
    assert events, f"no straggler event in {SLOW_STEPS} steps"
    first = events[0]
    assert (first["ranks"], first["phase"]) == ([slow_rank], phase)
    assert first["step"] < SLOW_STEPS
    assert first["lost_per_step"] > 0.8 * DELAY and first["slowdown"] >= 1.5
    named = {r for e in events for r in e["ranks"]}
    assert named == {slow_rank}, events
    assert {e["phase"] for e in events} == {phase}
    for rank in range(1, WORLD):  # the same verdict on every rank
        assert [e["ranks"] for e in _stragglers(runs / name, rank)] == [e["ranks"] for e in events]


@pytest.mark.timeout(120)
def test_healthy_steps_raise_nothing(runs: Path) -> None:
    assert _stragglers(runs / "healthy") == []
    for rank in range(WORLD):
        assert _stragglers(runs / "healthy", rank) == []


@pytest.mark.timeout(120)
def test_report_names_the_straggler(runs: Path) -> None:
    cmd = [sys.executable, "-m", "trainguard", "report", str(runs / "data"), "--no-html"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "stragglers  step " in out and ": ranks [2] slow in data (" in out
    [row] = [line for line in out.splitlines() if "straggler: data" in line]
    assert row.split()[0] == "2"  # the timing table flags rank 2
    assert float(row.split()[1]) > 0.8 * DELAY * 1e3  # its median data ms
