"""The sync-free ``guard.step()`` (a fused optimizer: each step's outcome is read a step late)
at the edges of a run: a checkpoint saved while a bad step is still unread counts it, and one
whose unread step stops the run raises when loaded; a stop read a step late leaves the next
step's BatchNorm writes undone, as ``check()`` leaves them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import trainguard as tg


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def _batches(bad: tuple[int, ...]) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(12)
    ]
    for step in bad:
        batches[step][0][0, 0] = float("nan")
    return batches


def _train(
    run_dir: Path,
    batches: list[tuple[Tensor, Tensor]],
    stop_at: int | None = None,
    state: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[tg.Guard, dict[str, Any] | None, nn.Module]:
    """Sync-free steps over ``batches`` (from the loaded ``state``'s step on); with
    ``stop_at``, saves ``guard.state_dict()`` at that global step and stops (a preemption)."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    saved = None
    guard = tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0, **options)
    assert guard._parts.sync_free is not None  # the fused optimizer: the sync-free step
    try:
        if state is not None:
            guard.load_state_dict(state)
        for x, y in guard.watch(batches[guard.global_step :]):
            if guard.global_step == stop_at:
                saved = guard.state_dict()
                break
            loss = (model(x) - y).square().mean()
            loss.backward()  # type: ignore[no-untyped-call]
            guard.step(loss)
    finally:
        try:
            guard.close()  # reads the last step: a stop raises here
        except tg.NonFiniteError:
            if saved is None:
                raise  # a preempted run (saved, then gone) never reads it
    return guard, saved, model


def _counters(guard: tg.Guard) -> tuple[int, int, list[int]]:
    state = guard.state
    return state.step, state.total_nonfinite, list(state.nonfinite_steps)


def test_a_checkpoint_saved_before_a_bad_step_is_read_counts_it(tmp_path: Path) -> None:
    batches = _batches(bad=(5,))
    whole, _, _ = _train(tmp_path / "whole", batches)
    _, saved, _ = _train(tmp_path / "first", batches, stop_at=6)  # step 5 not read yet
    assert saved is not None and saved["state"]["nonfinite_steps"] == [5]
    resumed, _, _ = _train(tmp_path / "second", batches, state=saved)
    assert _counters(resumed) == _counters(whole) == (12, 1, [5])
    assert resumed.metrics()["trainguard/skipped_steps"] == 1


def test_a_checkpoint_whose_unread_step_stops_the_run_raises_when_loaded(tmp_path: Path) -> None:
    batches = _batches(bad=(4, 5))
    with pytest.raises(tg.NonFiniteError) as whole:
        _train(tmp_path / "whole", batches, max_consecutive=2)
    assert whole.value.step == 5
    _, saved, _ = _train(tmp_path / "first", batches, stop_at=6, max_consecutive=2)
    assert saved is not None and saved["stopped_at"] == 5
    with pytest.raises(tg.NonFiniteError) as loaded:
        _train(tmp_path / "second", batches, state=saved, max_consecutive=2)
    assert loaded.value.step == 5


@pytest.mark.parametrize("options", [{"on_nonfinite": "raise"}, {"max_consecutive": 2}])
def test_a_stop_read_a_step_late_leaves_the_next_steps_buffers_undone(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    bad = (3,) if "on_nonfinite" in options else (2, 3)
    batches = _batches(bad=bad)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)  # the same kernels
    reference_guard = tg.Guard(model, opt, run_dir=tmp_path / "check", hang_timeout=0, **options)
    with pytest.raises(tg.NonFiniteError) as checked, reference_guard as guard:  # the reference
        for x, y in guard.watch(batches):
            loss = (model(x) - y).square().mean()
            loss.backward()  # type: ignore[no-untyped-call]
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    guard, raised, model = _train_until_raise(tmp_path / "sync-free", batches, **options)
    assert raised is not None and raised.step == checked.value.step == 3  # read a step late
    assert guard.global_step == 4  # the step after the stop is not counted, as with check()
    assert model[1].num_batches_tracked == reference["1.num_batches_tracked"]
    assert torch.equal(model[1].running_mean, reference["1.running_mean"])


def _train_until_raise(
    run_dir: Path, batches: list[tuple[Tensor, Tensor]], **options: Any
) -> tuple[tg.Guard, tg.NonFiniteError | None, nn.Module]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    guard = tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0, **options)
    raised = None
    try:
        for x, y in guard.watch(batches):
            loss = (model(x) - y).square().mean()
            loss.backward()  # type: ignore[no-untyped-call]
            guard.step(loss)
    except tg.NonFiniteError as error:
        raised = error
    finally:
        guard.close()
    return guard, raised, model
