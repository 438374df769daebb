"""The guard in one process: decisions, state, events, clipping, accumulation, AMP."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tg_models import TinyNet, flat_params, loss_fn, make_batches

import trainguard as tg
from trainguard.testing import Fault, FaultPlan


def _train(
    guard: tg.Guard, model: torch.nn.Module, plan: FaultPlan, n: int, always_step: bool = True
) -> list[bool]:
    results = []
    for batch in guard.watch(make_batches(n, seed=1)):
        step = guard.state.step
        loss = plan.loss(loss_fn(model, batch), step)
        loss.backward()
        plan.grads(model, step)
        results.append(guard.check(loss))
        if always_step or results[-1]:  # unconditional: a skipped step must not move weights
            guard.optimizer.step()
        guard.optimizer.zero_grad()
    return results


def _guard(tmp_path: Path, **kwargs: object) -> tuple[tg.Guard, TinyNet]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return tg.Guard(model, opt, run_dir=tmp_path, **kwargs), model  # type: ignore[arg-type]


def test_skip_clears_grads_and_keeps_weights(tmp_path: Path) -> None:
    guard, model = _guard(tmp_path)
    before = {}

    plan = FaultPlan([Fault(step=2), Fault(step=4, where="grad", param="head.weight")])
    for batch in guard.watch(make_batches(6, seed=1)):
        step = guard.state.step
        loss = plan.loss(loss_fn(model, batch), step)
        loss.backward()
        plan.grads(model, step)
        before[step] = flat_params(model).clone()
        ok = guard.check(loss)
        if not ok:
            assert all(p.grad is None for p in model.parameters())
        guard.optimizer.step()
        guard.optimizer.zero_grad()
        moved = not torch.equal(before[step], flat_params(model))
        assert moved == ok, f"step {step}: weights moved={moved} but check={ok}"
    assert torch.isfinite(flat_params(model)).all()
    for state in guard.optimizer.state.values():
        for value in state.values():
            assert torch.isfinite(value).all()
    assert guard.state.nonfinite_steps == type(guard.state.nonfinite_steps)([2, 4])
    assert guard.state.total_nonfinite == 2
    assert guard.state.last_good_step == 5


def test_events_name_where_ranks_and_params(tmp_path: Path) -> None:
    guard, model = _guard(tmp_path)
    plan = FaultPlan([Fault(step=1), Fault(step=3, where="grad", param="head.weight")])
    _train(guard, model, plan, 5)
    guard.close()
    events = tg.read_events(tmp_path)
    assert {"time", "rank", "step", "kind"} <= set(events[0])
    bad = [e for e in events if e["kind"] == "nonfinite"]
    assert [(e["step"], e["where"], e["ranks"]) for e in bad] == [
        (1, "loss", [0]),
        (3, "grad", [0]),
    ]
    assert bad[1]["params"] == ["head.weight"]
    assert bad[0]["loss"] == "nan"
    assert [e["step"] for e in events if e["kind"] == "skip"] == [1, 3]
    assert events[-1]["kind"] == "close"


def test_warn_leaves_grads_and_returns_false(tmp_path: Path) -> None:
    guard, model = _guard(tmp_path, on_nonfinite="warn")
    plan = FaultPlan([Fault(step=1, where="grad", param="head.bias")])
    results = _train(guard, model, plan, 3, always_step=False)
    assert results == [True, False, True]
    assert [e["action"] for e in tg.read_events(tmp_path) if e["kind"] == "nonfinite"] == ["warn"]


def test_raise_carries_step_and_ranks(tmp_path: Path) -> None:
    guard, model = _guard(tmp_path, on_nonfinite="raise")
    with pytest.raises(tg.NonFiniteError) as info:
        _train(guard, model, FaultPlan([Fault(step=2, value=float("inf"))]), 5)
    assert info.value.step == 2
    assert info.value.ranks == [0]


def test_escalates_after_max_consecutive(tmp_path: Path) -> None:
    guard, model = _guard(tmp_path, max_consecutive=3)
    plan = FaultPlan([Fault(step=s) for s in (1, 3, 4, 5, 6)])
    with pytest.raises(tg.NonFiniteError) as info:
        _train(guard, model, plan, 9)
    assert info.value.step == 5  # steps 3, 4, 5 in a row; step 1 was reset by step 2
    kinds = [(e["kind"], e["step"]) for e in tg.read_events(tmp_path)]
    assert ("escalate", 5) in kinds


def test_grad_clip_rides_on_the_check(tmp_path: Path) -> None:
    guard, model = _guard(tmp_path, grad_clip=0.01)
    ref = TinyNet()
    ref.load_state_dict(model.state_dict())
    batch = make_batches(1, seed=3)[0]
    loss_fn(model, batch).backward()
    loss_fn(ref, batch).backward()
    assert guard.check(loss_fn(model, batch).detach())
    expected_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert expected_norm > 0.01
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad)


def test_accumulation_any_bad_micro_loss_marks_step(tmp_path: Path) -> None:
    guard, model = _guard(tmp_path, accumulation_steps=3)
    results = []
    for i, batch in enumerate(guard.watch(make_batches(9, seed=2))):
        loss = loss_fn(model, batch) / 3
        if i == 4:  # second micro-batch of step 1: only the loss is bad, grads stay finite
            loss = loss + float("nan")
        loss.backward()
        guard.record_loss(loss)
        if (i + 1) % 3 == 0:
            results.append(guard.check(loss))
            guard.optimizer.step()
            guard.optimizer.zero_grad()
    assert results == [True, False, True]
    assert guard.state.step == 3


@pytest.mark.parametrize("batches", [10, 9])
def test_batches_short_of_a_whole_step_at_the_end_are_said(
    tmp_path: Path, batches: int, caplog: pytest.LogCaptureFixture
) -> None:
    """10 batches, 3 a step: 9 are trained in 3 steps, the last is not, and that is said
    (event, warning, report line); 9 batches: nothing to say."""
    from trainguard.report.summary import summarize
    from trainguard.report.text import report_text

    guard, model = _guard(tmp_path, accumulation_steps=3)
    handed = 0
    with guard:
        for i, batch in enumerate(guard.watch(make_batches(batches, seed=2))):
            handed += 1
            loss = loss_fn(model, batch) / 3
            loss.backward()
            guard.record_loss(loss)
            if (i + 1) % 3 == 0:
                guard.check(loss)
                guard.optimizer.step()
                guard.optimizer.zero_grad()
    assert (handed, guard.state.step) == (9, 3)
    partial = [e for e in tg.read_events(tmp_path, 0) if e["kind"] == "partial_step"]
    if batches == 9:
        assert partial == []
        return
    [event] = partial
    assert (event["steps"], event["dropped"], event["accumulation_steps"]) == (3, 1, 3)
    line = next(x for x in report_text(summarize(tmp_path)).splitlines() if "uneven data" in x)
    assert line.endswith("step 3: the pass ended 1 batch(es) short of a step of 3: not trained")
    assert "the pass ended 1 batch(es) short of a step of 3" in caplog.text


def test_state_dict_round_trip(tmp_path: Path) -> None:
    guard, model = _guard(tmp_path)
    _train(guard, model, FaultPlan([Fault(step=1)]), 3)
    saved = guard.state_dict()
    other, _ = _guard(tmp_path / "b")
    other.load_state_dict(saved)
    assert other.state.state_dict() == guard.state.state_dict()
    assert other.state.step == 3 and list(other.state.nonfinite_steps) == [1]


def test_nonfinite_steps_is_capped(tmp_path: Path) -> None:
    guard, model = _guard(tmp_path, max_consecutive=1000)
    guard.state.nonfinite_steps = type(guard.state.nonfinite_steps)(maxlen=100)
    _train(guard, model, FaultPlan([Fault(step=s) for s in range(120)]), 120)
    assert len(guard.state.nonfinite_steps) == 100
    assert guard.state.nonfinite_steps[-1] == 119
    assert guard.state.total_nonfinite == 120


def test_guard_step_skips_on_bad(tmp_path: Path) -> None:
    guard, model = _guard(tmp_path)
    plan = FaultPlan([Fault(step=1)])
    for batch in guard.watch(make_batches(3, seed=4)):
        before = flat_params(model).clone()
        loss = plan.loss(loss_fn(model, batch), guard.state.step)
        loss.backward()
        ok = guard.step(loss)
        assert bool(ok) == (not torch.equal(before, flat_params(model)))
        assert all(p.grad is None for p in model.parameters())
    assert guard.state.total_nonfinite == 1
    assert torch.isfinite(flat_params(model)).all()


def test_amp_overflow_is_not_a_nan_failure(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    guard = tg.Guard(model, opt, run_dir=tmp_path, scaler=scaler, max_consecutive=2)
    results = []
    for i, batch in enumerate(guard.watch(make_batches(5, seed=5))):
        loss = loss_fn(model, batch)
        scaled = scaler.scale(loss)
        if i in (1, 2, 3):  # overflow in the gradients, finite loss: the scaler's business
            scaled = scaled * 1e38
        scaled.backward()
        ok = guard.check(loss)
        results.append(ok)
        if ok:
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert results == [True, False, False, False, True]
    assert guard.state.overflow_steps == 3
    assert guard.state.total_nonfinite == 0  # overflows do not escalate (max_consecutive=2)
    assert scaler.get_scale() == 2.0**13
    kinds = [e["kind"] for e in tg.read_events(tmp_path)]
    assert kinds.count("overflow") == 3


def test_amp_collapsing_scale_escalates(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    guard = tg.Guard(model, opt, run_dir=tmp_path, scaler=scaler, min_loss_scale=1.0)
    with pytest.raises(tg.LossScaleCollapseError) as info:
        for batch in guard.watch(make_batches(10, seed=6)):
            loss = loss_fn(model, batch)
            (scaler.scale(loss) * math.inf).backward()
            if guard.check(loss):
                scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert info.value.step == 4  # scale 8, 4, 2, 1 overflow; then 0.5 < 1.0
    assert any(e["kind"] == "escalate" for e in tg.read_events(tmp_path))


def test_the_loop_is_done_once_watch_ends_or_is_left(tmp_path: Path) -> None:
    """The watchdog's phase: "step" while batches are handed out, "done" once the loop ran
    out, and once it was left early (a ``break``: the generator is closed)."""
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=tmp_path) as guard:
        phases = []
        for batch in guard.watch(make_batches(3, seed=0)):
            phases.append(guard.progress.phase)
            loss = loss_fn(model, batch)
            loss.backward()
            guard.step(loss)
        assert phases == ["step"] * 3 and guard.progress.phase == "done"
        for _ in guard.watch(make_batches(5, seed=1)):
            assert guard.progress.phase == "step"
            break
        assert guard.progress.phase == "done"
