"""An Inf (not NaN) gradient under a finite loss: the guard's gradient check must see it.

The gradient is made infinite inside backward (a hook on one parameter), the way an
overflowing kernel would, while the loss stays finite: only the gradient pass can tell, and
it must tell Inf as well as NaN (a check written as ``isnan`` would pass this step).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_models import TinyNet, flat_params, make_batches
from torch import Tensor

import trainguard as tg

BAD_STEP = 1
BAD_PARAM = "head.weight"


def _nonfinite_events(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == "nonfinite"]


def _inf_into_first_element(value: float) -> Any:
    def hook(grad: Tensor) -> Tensor:
        out = grad.clone()
        out.view(-1)[0] = value
        return out

    return hook


def _loss(model: TinyNet, batch: Tensor, step: int, value: float) -> Tensor:
    """A finite loss; at ``BAD_STEP`` backward writes ``value`` into one gradient element."""
    handle = None
    if step == BAD_STEP:
        handle = model.head.weight.register_hook(_inf_into_first_element(value))
    loss: Tensor = model(batch).pow(2).mean()
    loss.backward()
    if handle is not None:
        handle.remove()
    return loss


def _optimizer_state(opt: torch.optim.Optimizer) -> list[dict[str, Tensor]]:
    return [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_check_rejects_an_inf_gradient_under_a_finite_loss(tmp_path: Path, value: float) -> None:
    """check() returns False, names the parameter (where="grad") and clears the gradients."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = tg.Guard(model, opt, run_dir=tmp_path, capture=False, hang_timeout=0)
    results: list[bool] = []
    for step, batch in enumerate(make_batches(3, seed=1)):
        loss = _loss(model, batch, step, value)
        assert math.isfinite(loss.item())
        if step == BAD_STEP:
            grad = model.head.weight.grad
            assert grad is not None and grad.view(-1)[0].item() == value  # the fault is in
        before = flat_params(model).clone()
        ok = guard.check(loss)
        results.append(ok)
        assert ok == (step != BAD_STEP), f"step {step}: check() returned {ok}"
        if not ok:
            assert all(p.grad is None for p in model.parameters()), "grads not cleared"
        opt.step()  # unconditional: a rejected step must not move the weights
        opt.zero_grad(set_to_none=True)
        assert torch.equal(before, flat_params(model)) == (not ok)
    guard.close()
    assert results == [True, False, True]
    assert torch.isfinite(flat_params(model)).all()
    [event] = _nonfinite_events(tmp_path)
    assert event["step"] == BAD_STEP
    assert event["where"] == "grad"
    assert event["ranks"] == [0] and event["grad_ranks"] == [0] and event["loss_ranks"] == []
    assert event["params"] == [BAD_PARAM]
    assert math.isfinite(float(event["loss"]))
    assert list(guard.state.nonfinite_steps) == [BAD_STEP]


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_sync_free_step_skips_an_inf_gradient_on_the_device(tmp_path: Path, value: float) -> None:
    """The fused optimizer leaves weights, moments and step counts alone; the late read
    writes the same event as check()."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    guard = tg.Guard(model, opt, run_dir=tmp_path, capture=False, hang_timeout=0)
    moved: list[bool] = []
    outcomes: list[Any] = []  # StepOutcome: read when tested
    states: list[tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]] = []
    for step, batch in enumerate(make_batches(3, seed=1)):
        loss = _loss(model, batch, step, value)
        before, state_before = flat_params(model).clone(), _optimizer_state(opt)
        outcome = guard.step(loss)
        assert repr(outcome) == "StepOutcome(pending)", "step() is not sync-free"
        assert all(p.grad is None for p in model.parameters())
        moved.append(not torch.equal(before, flat_params(model)))
        states.append((state_before, _optimizer_state(opt)))
        outcomes.append(outcome)
    guard.close()
    assert moved == [True, False, True]
    assert [bool(o) for o in outcomes] == [True, False, True]
    before_bad, after_bad = states[BAD_STEP]
    assert len(before_bad) == len(after_bad) > 0
    for old, new in zip(before_bad, after_bad, strict=True):  # moments and step counts kept
        assert old.keys() == new.keys()
        assert all(torch.equal(old[k], new[k]) for k in old)
    assert {float(s["step"]) for s in opt.state.values()} == {2.0}
    for opt_state in opt.state.values():
        assert all(torch.isfinite(v).all() for v in opt_state.values())
    [event] = _nonfinite_events(tmp_path)
    assert event["step"] == BAD_STEP
    assert event["where"] == "grad"
    assert event["ranks"] == [0] and event["loss_ranks"] == []
    assert event["params"] == [BAD_PARAM]
    assert list(guard.state.nonfinite_steps) == [BAD_STEP]
