"""``trainguard run``'s handover to an optimizer the script made anew (``attach/replace.py``),
in one process; the scripts under ``trainguard run`` (1 process, 2-rank torchrun with a
clip) are in tests/distributed/test_run_attach.py."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import trainguard as tg
from trainguard.attach.replace import HANDOVER, hand_over, step_start


def _guard(
    model: nn.Module, optimizer: torch.optim.Optimizer, run_dir: Path, run: str | None
) -> tg.Guard:
    config = tg.GuardConfig(run_dir=run_dir, run=run, extra=dict(HANDOVER) if run else {})
    guard = tg.Guard(model, optimizer, config=config)
    guard._parts.drop_update.keep_dropped = True  # as trainguard run has it
    return guard


def _train(model: nn.Module, guard: tg.Guard, optimizer: torch.optim.Optimizer) -> None:
    """Steps 0-2, step 1 bad."""
    x = torch.randn(8, 3)
    for step in range(3):
        loss = model(x if step != 1 else x * float("nan")).pow(2).mean()
        loss.backward()
        if guard.check(loss):
            optimizer.step()
        optimizer.zero_grad()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def test_the_new_guard_goes_on_with_the_run_the_counters_and_the_steps_start(
    tmp_path: Path,
) -> None:
    model = _model()
    first = torch.optim.SGD(model[2].parameters(), lr=0.1)  # the head, then everything
    old = _guard(model, first, tmp_path, None)
    _train(model, old, first)
    # step 3: the forward under the old guard, then the script makes a new optimizer
    running_mean = model[1].running_mean.clone()
    model(torch.randn(8, 3)).pow(2).mean().backward()
    assert not torch.equal(model[1].running_mean, running_mean)  # the forward moved it
    start = step_start(old)
    assert start is not None and start.rng is not None
    second = torch.optim.Adam(model.parameters(), lr=0.1)
    new = hand_over(old, second, lambda run: _guard(model, second, tmp_path, run))
    try:
        assert new.optimizer is second and new.events.run is not None
        assert old.events.run is not None and new.events.run.id == old.events.run.id
        assert (new.state.step, new.state.total_nonfinite) == (3, 1)
        assert (
            new._parts.step_start.step == 3 and new._parts.step_start.seen
        )  # the step's start, carried
        with torch.no_grad():
            model[0].weight.grad[0, 0] = float("nan")  # step 3 turns out bad
        assert not new.check_gradients()
        assert torch.equal(model[1].running_mean, running_mean)  # put back: the carried start
        assert all(p.grad is None for p in model.parameters())
    finally:
        new.close()
    events = tg.read_events(tmp_path, 0)
    kinds = [e["kind"] for e in events]
    assert kinds.count("start") == 2 and kinds.count("optimizer_replaced") == 1
    (replaced,) = [e for e in events if e["kind"] == "optimizer_replaced"]
    assert (replaced["old"], replaced["new"], replaced["step"]) == ("SGD", "Adam", 3)
    handovers = [e.get("handover") for e in events if e["kind"] == "start"]
    assert handovers == [None, "optimizer_replaced"]
    assert "state_loaded" not in kinds  # the run goes on; it does not begin at step 3
    assert [e["step"] for e in events if e["kind"] == "skip"] == [1, 3]
    assert (tmp_path / "captures" / "step-00000003").is_dir()


def test_a_step_the_old_guard_skipped_gets_its_gradients_back_from_the_new(
    tmp_path: Path,
) -> None:
    """The script clipped: the old guard checked (and skipped) step 3 at the clip, then the
    new optimizer stepped; the dropped gradients go back after that step, as after any."""
    model = _model()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    old = _guard(model, first, tmp_path, None)
    _train(model, old, first)
    model(torch.randn(8, 3)).pow(2).mean().backward()
    with torch.no_grad():
        model[2].weight.grad[0, 0] = float("inf")
    assert not old.check_gradients()  # at the clip: skipped, the gradients held
    assert all(p.grad is None for p in model.parameters())
    second = torch.optim.SGD(model.parameters(), lr=0.1)
    new = hand_over(old, second, lambda run: _guard(model, second, tmp_path, run))
    try:
        assert new.state.step == 4 and step_start(new) is None
        second.step()  # nothing to update
        new._parts.drop_update.give_back()  # the attacher's post-step hook
        assert model[2].weight.grad is not None and model[2].weight.grad[0, 0] == float("inf")
    finally:
        new.close()
