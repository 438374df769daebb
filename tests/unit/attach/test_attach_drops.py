"""``trainguard run``'s watch of a step the script leaves out itself (attach/drops.py), in one
process: which ``zero_grad`` calls are a drop, the row and the decision it leads to, and the
report's count. The 2-rank behaviour (every rank leaves it out, in one all-reduce):
tests/distributed/test_run_attach.py."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from trainguard.attach.drops import DropWatch
from trainguard.config import GuardConfig
from trainguard.report.decisions import decision_counts
from trainguard.step.consensus import Consensus, _host_columns
from trainguard.step.guard import Guard
from trainguard.step.policy import decide
from trainguard.step.types import (
    DROPPED_BY_LOOP,
    DROPPED_WITH_SCALER,
    Agreement,
    Decision,
    LocalReport,
    Reduced,
)


class Wrapper(nn.Module):
    """A module around the model, as DDP is (``.module``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


Loop = tuple[Guard, DropWatch, Wrapper, torch.optim.Optimizer]


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Loop]:
    torch.manual_seed(0)
    model = Wrapper(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, optimizer, run_dir=tmp_path, hang_timeout=0)
    drops = DropWatch()
    drops.attach(guard, optimizer, model, lambda: False)
    try:
        yield guard, drops, model, optimizer
    finally:
        drops.remove()
        guard.close()


def _forward(drops: DropWatch, model: nn.Module) -> torch.Tensor:
    loss = model(torch.randn(4, 4)).square().mean()
    drops.forward()  # what the attacher's forward pre-hook calls
    return loss


def _decisions(guard: Guard) -> list[str]:
    return [record.decision for record in guard.history.records()]


def test_zero_grad_after_a_backward_without_a_check_is_a_drop(loop: Loop) -> None:
    guard, drops, model, optimizer = loop
    _forward(drops, model).backward()
    guard.check_gradients()
    optimizer.step()
    optimizer.zero_grad()
    _forward(drops, model).backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()  # no optimizer.step(): the loop left step 1 out
    assert _decisions(guard) == ["ok", "dropped"] and guard.state.step == 2
    assert all(p.grad is None for p in model.parameters())  # the script's zero_grad ran
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert guard.state.total_nonfinite == 0  # not a bad step
    optimizer.zero_grad()  # again: nothing left out any more
    assert guard.state.step == 2


@pytest.mark.parametrize("owner", ["model", "model.module"])
def test_the_models_zero_grad_counts_too(loop: Loop, owner: str) -> None:
    guard, drops, model, _ = loop
    _forward(drops, model).backward()
    (model if owner == "model" else model.module).zero_grad()
    assert _decisions(guard) == ["dropped"]


def test_zero_grad_between_forward_and_backward_is_no_drop(loop: Loop) -> None:
    guard, drops, model, optimizer = loop
    for _ in range(3):
        loss = _forward(drops, model)
        optimizer.zero_grad()  # the gradients of the last step, still there
        loss.backward()
        guard.check_gradients()
        optimizer.step()
    assert _decisions(guard) == ["ok", "ok", "ok"]


def test_accumulation_and_an_in_place_zero_grad_are_no_drop(loop: Loop) -> None:
    guard, drops, model, optimizer = loop
    for _ in range(2):
        for _ in range(3):  # micro-batches: forwards after a backward, the same step
            _forward(drops, model).backward()
        guard.check_gradients()
        optimizer.step()
        model.zero_grad(set_to_none=False)  # zeroed in place: a new version, after the check
    assert _decisions(guard) == ["ok", "ok"]
    _forward(drops, model).backward()  # accumulates into the zeroed gradients (in place)
    optimizer.zero_grad(set_to_none=False)
    assert _decisions(guard) == ["ok", "ok", "dropped"]


def test_the_guards_own_zero_grad_and_other_optimizers_are_ignored(loop: Loop) -> None:
    guard, drops, model, _ = loop
    _forward(drops, model).backward()
    drops.busy = True  # inside the guard's check (a skip clears the gradients)
    model.zero_grad()
    drops.busy = False
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    other.zero_grad()
    assert _decisions(guard) == []


def test_remove_puts_the_original_methods_back(tmp_path: Path) -> None:
    originals = (torch.optim.Optimizer.zero_grad, nn.Module.zero_grad)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, optimizer, run_dir=tmp_path, hang_timeout=0)
    drops = DropWatch()
    drops.attach(guard, optimizer, model, lambda: False)
    assert (torch.optim.Optimizer.zero_grad, nn.Module.zero_grad) != originals
    drops.remove()
    guard.close()
    assert (torch.optim.Optimizer.zero_grad, nn.Module.zero_grad) == originals


def _agreement(drops: list[float], norms: list[float]) -> Agreement:
    """The agreement two ranks' rows (only ``dropped`` and the gradient norm set) make."""
    consensus = Consensus(None, torch.device("cpu"))
    consensus.world_size = len(drops)
    rows: list[float] = []
    for dropped, norm in zip(drops, norms, strict=True):
        report = LocalReport(torch.tensor([0.5, 0.5, norm, 0.0, 0.0]), dropped=dropped)
        rows += [
            0.5,
            0.5,
            norm,
            0.0,
            0.0,
            *_host_columns(report),
            0.0,
            0.0,
            0.0,
        ]  # no scale, not leaving, the loss seen
    report = LocalReport(torch.zeros(5))
    return consensus.read(rows, Reduced(report.values, report, False))


def test_the_row_carries_the_drop_and_every_rank_decides_alike() -> None:
    config = GuardConfig()
    agreement = _agreement([0.0, DROPPED_BY_LOOP], [1.0, 1.0])
    assert agreement.dropped_ranks == [1] and not agreement.bad
    assert decide(agreement, config, 0) is Decision.DROPPED
    assert decide(_agreement([0.0, 0.0], [1.0, 1.0]), config, 0) is Decision.OK
    nan = _agreement([0.0, DROPPED_BY_LOOP], [math.nan, math.nan])
    assert decide(nan, config, 0) is Decision.SKIP  # a bad step stays one
    both = [DROPPED_WITH_SCALER, DROPPED_WITH_SCALER]
    assert decide(_agreement(both, [math.inf, math.inf]), config, 0) is Decision.OVERFLOW
    one = _agreement([0.0, DROPPED_WITH_SCALER], [math.inf, math.inf])
    assert decide(one, config, 0) is Decision.SKIP  # a rank stepped: not the scaler's
    assert decide(_agreement(both, [1.0, 1.0]), config, 0) is Decision.DROPPED


def test_a_world_of_one_reads_its_drop_from_its_own_row() -> None:
    report = LocalReport(torch.tensor([0.5, 0.5, 1.0, 0.0, 0.0]), dropped=DROPPED_BY_LOOP)
    agreement = Consensus(None, torch.device("cpu")).agree(report, False)
    assert agreement.dropped_ranks == [0]
    assert decide(agreement, GuardConfig(), 0) is Decision.DROPPED


def test_the_report_counts_dropped_steps_apart() -> None:
    counts = decision_counts([{"action": "skip"}], {"dropped": 2, "overflow": 0}, [], 10, 10)
    assert counts == {"ok": 7, "dropped": 2, "skip": 1}
