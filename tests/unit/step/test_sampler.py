"""Sampler pitfalls: a second epoch of a DistributedSampler loader without set_epoch warns
(with it, none); ranks whose loaders differ in length are reported when the loop starts."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tg_models import TinyNet
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import trainguard as tg
from trainguard.events import EventLog
from trainguard.hang.progress import Progress
from trainguard.step.batch_stream import BatchStream, iterable_length
from trainguard.step.consensus import COLUMNS, Consensus
from trainguard.step.types import Agreement, LocalReport, Reduced


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


class _TwoRanks(Consensus):
    """Rank 0 of a pretend world of two; rank 1's row is scripted: a loader of ``other``
    batches, all fetched (it holds exactly ``other`` steps)."""

    def __init__(self, other: int) -> None:
        super().__init__()
        self.world_size = 2
        self.other = other

    def agree(self, report: LocalReport, sum_grad_norms: bool) -> Agreement:
        host = [float(report.exhausted), float(report.batches), *[0.0] * 7]
        mine = [*report.values.tolist(), *host]  # + data, compute, dropped, lr, scale,
        # leaving, loss_unknown
        # loss column = its len(); grad norm, input, fingerprint 0; exhausted, all fetched
        theirs = [float(self.other), 0.0, 0.0, 0.0, 0.0, 1.0, float(self.other)] + [0.0] * 7
        assert len(mine) == len(theirs) == len(COLUMNS)
        reduced = Reduced(torch.tensor(mine + theirs), report, sum_grad_norms)
        return self.read(mine + theirs, reduced)


def _stream(run_dir: Path, iterable: Iterable[int], other: int) -> list[int]:
    events = EventLog(run_dir, 0)
    stream = BatchStream(iterable, 1, _TwoRanks(other), Progress(), events, step_of=lambda: 0)
    taken = []
    for item in stream:
        if not taken:  # the start's report is written before the first batch is handed out
            assert [e["kind"] for e in tg.read_events(run_dir, 0)] == ["uneven_lengths"]
        taken.append(item)
    events.close()
    return taken


def test_uneven_lengths_are_reported_at_the_start(tmp_path: Path) -> None:
    taken = _stream(tmp_path, list(range(6)), other=4)
    assert taken == [0, 1, 2, 3]  # the run still stops at the shortest rank's end
    start, end = tg.read_events(tmp_path, 0)
    assert start["kind"] == "uneven_lengths" and start["step"] == 0
    assert start["lengths"] == [6, 4]
    assert start["shortest_ranks"] == [1] and start["steps_at_most"] == 4
    assert end["kind"] == "uneven_data" and end["steps"] == 4


def test_equal_or_unknown_lengths_write_no_start_report(tmp_path: Path) -> None:
    assert _stream_quiet(tmp_path / "equal", list(range(4)), other=4) == [0, 1, 2, 3]
    # a generator has no len(): nothing to compare at the start (the end still agrees)
    assert _stream_quiet(tmp_path / "gen", iter(range(6)), other=4) == [0, 1, 2, 3]
    assert [e["kind"] for e in tg.read_events(tmp_path / "gen", 0)] == ["uneven_data"]
    assert iterable_length(iter(range(3))) == -1 and iterable_length([1, 2]) == 2


def _stream_quiet(run_dir: Path, iterable: Iterable[int], other: int) -> list[int]:
    events = EventLog(run_dir, 0)
    stream = BatchStream(iterable, 1, _TwoRanks(other), Progress(), events, step_of=lambda: 0)
    taken = list(stream)
    events.close()
    assert not [e for e in tg.read_events(run_dir, 0) if e["kind"] == "uneven_lengths"]
    return taken
