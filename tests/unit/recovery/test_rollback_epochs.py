"""A rollback into an earlier epoch, in one process: the skip ledger and the ``rollback`` event
hold every batch the rollback undid (the rest of the snapshot's epoch included, with their
dataset indices), and the warning about a scheduler the guard does not know says how far it
really runs ahead."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import trainguard as tg
from trainguard.testing import poison_loss

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "single process"

BATCH, BATCHES = 2, 8  # 8 batches an epoch


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """16 samples; each item carries its index, so the test knows what was fed."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(BATCH * BATCHES, 4, generator=gen)
        self.y = torch.randn(BATCH * BATCHES, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def _train(
    run_dir: Path, loader: DataLoader[Any], bad: range, **options: Any
) -> dict[tuple[int, int], list[int]]:
    """Three epochs; the checks of ``bad`` (counted over the loop) made non-finite. Returns
    the samples fed at each (epoch, position in the epoch)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = tg.GuardConfig.from_options(
        {
            "run_dir": run_dir,
            "on_escalation": "rollback",
            "max_consecutive": 5,
            "recovery.good_after": 2,
            **options,
        }
    )
    fed: dict[tuple[int, int], list[int]] = {}
    calls = 0
    with tg.Guard(model, opt, config=config) as guard, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for epoch in range(3):
            sampler = getattr(loader, "sampler", None)
            if isinstance(sampler, DistributedSampler):
                sampler.set_epoch(epoch)
            for position, (x, y, index) in enumerate(guard.watch(loader, epoch=epoch)):
                fed[(epoch, position)] = [int(i) for i in index]
                loss = nn.functional.mse_loss(model(x), y)
                if calls in bad:
                    loss = poison_loss(loss)
                loss.backward()  # type: ignore[no-untyped-call]
                if guard.check(loss):
                    opt.step()
                opt.zero_grad()
                calls += 1
    return fed


def _ledger(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "recovery" / "skipped-rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rollback(run_dir: Path) -> dict[str, Any]:
    (event,) = [e for e in tg.read_events(run_dir, 0) if e["kind"] == "rollback"]
    return event


@pytest.mark.parametrize("source", ["memory", "disk"])
def test_a_rollback_into_the_last_epoch_skips_the_rest_of_it_too(
    tmp_path: Path, source: str
) -> None:
    # steps 6..10 are bad: the escalation at step 10 (epoch 1, batch 2) goes back to step 4
    # (epoch 0, batch 4): epoch 0's batches 4..7 and epoch 1's 0..2 are undone
    options = {"recovery.snapshot_every": 4} if source == "memory" else {"checkpoint_every": 4}
    loader = DataLoader(Indexed(), batch_size=BATCH)  # sequential
    fed = _train(tmp_path, loader, range(6, 11), **options)
    event = _rollback(tmp_path)
    assert (event["step"], event["restored_step"], event["source"]) == (10, 4, source)
    undone = [(0, 4), (0, 5), (0, 6), (0, 7), (1, 0), (1, 1), (1, 2)]
    assert [(e["epoch"], e["batch"]) for e in _ledger(tmp_path)] == undone
    assert [e["samples"] for e in _ledger(tmp_path)] == [fed[key] for key in undone]
    assert event["epoch"] == 1 and event["batches_skipped"] == [0, 1, 2]
    assert event["earlier_batches_skipped"] == [{"epoch": 0, "batches": [4, 5, 6, 7]}]
    assert event["samples_skipped"] == [i for key in undone for i in fed[key]]


def test_the_indices_of_a_shuffled_earlier_epoch_are_the_ones_it_fed(tmp_path: Path) -> None:
    sampler = DistributedSampler(Indexed(), num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = DataLoader(Indexed(), batch_size=BATCH, sampler=sampler)
    fed = _train(tmp_path, loader, range(6, 11), **{"recovery.snapshot_every": 4})
    entries = _ledger(tmp_path)
    assert [(e["epoch"], e["batch"]) for e in entries][:4] == [(0, 4), (0, 5), (0, 6), (0, 7)]
    assert [e["samples"] for e in entries] == [fed[(e["epoch"], e["batch"])] for e in entries]
    assert fed[(0, 4)] != fed[(1, 4)]  # the order really changed with the epoch
    assert sampler.epoch == 2  # read again at epoch 0, and set back


def test_the_warning_names_how_far_an_unknown_scheduler_runs_ahead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    config = tg.GuardConfig(
        run_dir=tmp_path,
        on_escalation="rollback",
        max_consecutive=5,
        recovery=tg.RecoveryConfig(snapshot_every=10),
    )
    data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(40)]
    leads = []
    with tg.Guard(model, opt, config=config) as guard, caplog.at_level(logging.WARNING):
        for calls, (x, y) in enumerate(guard.watch(data)):
            loss = nn.functional.mse_loss(model(x), y)
            if 14 <= calls <= 18 or 25 <= calls <= 29:  # two escalations, each back to step 10
                loss = poison_loss(loss)
            loss.backward()  # type: ignore[no-untyped-call]
            if guard.check(loss):  # the documented pattern: the scheduler steps with the update
                opt.step()
                sched.step()
            opt.zero_grad()
            if calls in (18, 29):  # the two escalations: rolled back to step 10 each time
                leads.append(sched.last_epoch - guard.global_step)
    warned = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    # the first rollback undid steps 10..13 (4 updates); the second 10..15 (6 more): the
    # scheduler's real lead is 4, then 10, and the warnings say so
    assert leads == [4, 10]
    assert len(warned) == 2  # at each rollback (at construction: a Python warning)
    assert "taken 4 step(s)" in warned[0] and "taken 10 step(s)" in warned[1]
    assert sched.last_epoch - guard.global_step == 10
