"""A second epoch of a DistributedSampler loader without set_epoch warns; with it, none."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tg_models import TinyNet
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import trainguard as tg


def _two_epochs(run_dir: Path, set_epoch: bool) -> list[dict[str, object]]:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(8, 8))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0) as guard:
        for epoch in range(2):
            if set_epoch:
                sampler.set_epoch(epoch)
            for (x,) in guard.watch(loader):
                loss = model(x).pow(2).mean()
                loss.backward()
                guard.step(loss)
    lines = (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == "sampler_epoch"]


def test_forgotten_set_epoch_warns_at_the_second_epoch(tmp_path: Path) -> None:
    [event] = _two_epochs(tmp_path / "forgot", set_epoch=False)
    assert event["step"] == 2 and event["epoch"] == 0
    assert _two_epochs(tmp_path / "ok", set_epoch=True) == []
