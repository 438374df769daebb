"""guard.step() with a fused optimizer: skip on the device, read the flags a step later."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tg_models import TinyNet, flat_params, loss_fn, make_batches
from tg_ops import OpRecorder

import trainguard as tg
from trainguard.step.deferred import PendingStep
from trainguard.testing import Fault, FaultPlan


def _setup(tmp_path: Path, **kwargs: Any) -> tuple[tg.Guard, TinyNet]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return tg.Guard(model, opt, run_dir=tmp_path, **kwargs), model


def test_bad_steps_are_skipped_on_device_and_reported_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    guard, model = _setup(tmp_path)
    reads: list[tuple[int, int]] = []  # (step being read, step in progress)
    original = PendingStep.values

    def counting(self: PendingStep) -> list[float]:
        reads.append((self.step, guard.state.step - 1))
        return original(self)

    monkeypatch.setattr(PendingStep, "values", counting)
    plan = FaultPlan([Fault(step=2), Fault(step=4, where="grad", param="head.weight")])
    moved = []
    for batch in guard.watch(make_batches(7, seed=1)):
        step = guard.state.step
        loss = plan.loss(loss_fn(model, batch), step)
        loss.backward()
        plan.grads(model, step)
        before = flat_params(model).clone()
        guard.step(loss)  # outcome not tested: nothing is read for this step yet
        moved.append(not torch.equal(before, flat_params(model)))
    assert moved == [True, True, False, True, False, True, True]
    assert reads == [(s - 1, s) for s in range(1, 7)]  # each step's flags read a step late
    guard.close()
    assert reads[-1] == (6, 6)  # the last one on close
    assert list(guard.state.nonfinite_steps) == [2, 4]
    assert guard.state.last_good_step == 6
    steps = {float(s["step"]) for s in guard.optimizer.state.values()}
    assert steps == {5.0}  # 7 steps, 2 skipped: the fused kernel undid those step counts
    for opt_state in guard.optimizer.state.values():
        assert all(torch.isfinite(v).all() for v in opt_state.values())
    bad = [(e["step"], e["where"]) for e in tg.read_events(tmp_path) if e["kind"] == "nonfinite"]
    assert bad == [(2, "loss"), (4, "grad")]


def test_testing_the_outcome_reads_it_now(tmp_path: Path) -> None:
    guard, model = _setup(tmp_path)
    plan = FaultPlan([Fault(step=1)])
    results = []
    for batch in guard.watch(make_batches(3, seed=2)):
        loss = plan.loss(loss_fn(model, batch), guard.state.step)
        loss.backward()
        results.append(bool(guard.step(loss)))
    assert results == [True, False, True]


def test_raise_surfaces_at_the_next_step_before_its_update(tmp_path: Path) -> None:
    guard, model = _setup(tmp_path, on_nonfinite="raise")
    plan = FaultPlan([Fault(step=2)])
    snapshots = {}
    with pytest.raises(tg.NonFiniteError) as info:
        for batch in guard.watch(make_batches(6, seed=3)):
            step = guard.state.step
            snapshots[step] = flat_params(model).clone()
            loss = plan.loss(loss_fn(model, batch), step)
            loss.backward()
            guard.step(loss)
    assert info.value.step == 2
    assert step == 3  # raised while stepping step 3 ...
    assert torch.equal(flat_params(model), snapshots[2])  # ... and neither 2 nor 3 applied


def test_clip_on_device_matches_the_exact_path(tmp_path: Path) -> None:
    torch.manual_seed(0)
    models = [TinyNet(), TinyNet()]
    models[1].load_state_dict(models[0].state_dict())
    fused = torch.optim.AdamW(models[0].parameters(), lr=1e-2, fused=True)
    plain = torch.optim.AdamW(models[1].parameters(), lr=1e-2, fused=True)
    guards = [
        tg.Guard(models[0], fused, run_dir=tmp_path / "a", grad_clip=0.05),
        tg.Guard(models[1], plain, run_dir=tmp_path / "b", grad_clip=0.05),
    ]
    for batch in make_batches(4, seed=4):
        loss = loss_fn(models[0], batch)
        loss.backward()
        guards[0].step(loss)  # sync-free: clip factor computed on the device
        loss = loss_fn(models[1], batch)
        loss.backward()
        assert guards[1].check(loss)  # exact path: clip factor from the host
        plain.step()
        plain.zero_grad()
    torch.testing.assert_close(flat_params(models[0]), flat_params(models[1]))


def test_good_step_issues_no_host_read(tmp_path: Path) -> None:
    guard, model = _setup(tmp_path, grad_clip=1.0)
    batches = make_batches(3, seed=5)
    for batch in batches[:2]:
        loss_fn(model, batch).backward()
        guard.step(loss_fn(model, batch).detach())
    loss = loss_fn(model, batches[2])
    loss.backward()
    guard._parts.sync_free.pending = (
        None  # isolate this step's own work from reading the previous one
    )
    with OpRecorder() as rec:
        guard.step(loss)
    names = [name for name, _ in rec.ops]
    assert "_local_scalar_dense" not in names and "is_nonzero" not in names
    assert "_fused_adamw_" in names
