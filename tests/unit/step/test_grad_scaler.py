"""fp16 with a GradScaler on the CPU (``torch.amp.GradScaler("cpu")``, fp16 autocast): the
guarded loop trains as the bare one, through a plain optimizer and through accelerate's
``AcceleratedOptimizer``, which steps the optimizer it holds through the same scaler and
updates the scaler inside its own ``step()`` (accelerate's fp16 on a GPU).

Before: the guard unscaled through the wrapper and the wrapper's step unscaled the inner
optimizer a second time (every update divided by the scale: not the bare run's weights).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import trainguard as tg
from trainguard.events import read_events

STEPS = 16
INIT_SCALE = 2.0**20
"""So high that the first steps overflow in fp16 and the scaler brings it down, as at the
start of a real fp16 run: the scaler's own skips, not faults."""


def _batches() -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(STEPS)
    ]


class Run:
    """One loop: a model, AdamW (wrapped by accelerate's optimizer when ``wrapped``), a CPU
    GradScaler and a scheduler; ``nan_at`` makes that step's loss NaN."""

    def __init__(self, wrapped: bool, nan_at: int = -1) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        self.optimizer: Any = self.inner
        self.scheduler: Any = torch.optim.lr_scheduler.StepLR(self.inner, step_size=1, gamma=0.9)
        if wrapped:
            accelerate = pytest.importorskip("accelerate")
            accelerate.Accelerator(cpu=True)  # accelerate's state, as a script has it
            from accelerate.optimizer import AcceleratedOptimizer
            from accelerate.scheduler import AcceleratedScheduler

            self.optimizer = AcceleratedOptimizer(
                self.inner, device_placement=False, scaler=self.scaler
            )
            self.scheduler = AcceleratedScheduler(self.scheduler, self.optimizer)
        self.wrapped = wrapped
        self.nan_at = nan_at

    def loss(self, step: int, x: Tensor, y: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(self.model(x).float(), y)
        if step == self.nan_at:
            loss = loss * float("nan")
        self.scaler.scale(loss).backward()
        return loss

    def step(self, good: bool) -> None:
        """The loop's update: accelerate's optimizer steps through the scaler and updates it;
        a plain loop steps through the scaler when the guard says so, and updates it always."""
        if self.wrapped:
            if good:
                self.optimizer.step()
        else:
            if good:
                self.scaler.step(self.optimizer)
            self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad()

    def result(self) -> dict[str, Any]:
        return {
            "params": [p.detach().clone() for p in self.model.parameters()],
            "scale": self.scaler.get_scale(),
            "lr": self.inner.param_groups[0]["lr"],
            "opt_steps": float(next(iter(self.inner.state.values()))["step"]),
        }


def _bare(wrapped: bool, nan_at: int = -1) -> dict[str, Any]:
    run = Run(wrapped, nan_at)
    for step, (x, y) in enumerate(_batches()):
        run.loss(step, x, y)
        run.step(True)
    return run.result()


def _guarded(
    tmp_path: Path,
    wrapped: bool,
    nan_at: int = -1,
    always_step: bool = True,
    guard_steps: bool = False,
) -> tuple[dict[str, Any], tg.Guard]:
    """The guarded loop. ``always_step``: under accelerate, ``optimizer.step()`` at every step
    (its scaler leaves out a step the guard marked bad), as docs/guard.md#accelerate says.
    ``guard_steps``: ``guard.step(loss)`` makes the update (and the scaler's)."""
    run = Run(wrapped, nan_at)
    guard = tg.Guard(run.model, run.optimizer, scaler=run.scaler, run_dir=tmp_path, hang_timeout=0)
    for step, (x, y) in enumerate(guard.watch(_batches())):
        loss = run.loss(step, x, y)
        if guard_steps:
            guard.step(loss)
            run.scheduler.step()
            continue
        good = guard.check(loss)
        run.step(good or (wrapped and always_step))
    guard.close()
    return run.result(), guard


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"], strict=True))
    assert (a["scale"], a["lr"], a["opt_steps"]) == (b["scale"], b["lr"], b["opt_steps"])


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "accelerate"])
def test_the_scalers_own_overflows_train_as_the_bare_loop(tmp_path: Path, wrapped: bool) -> None:
    bare = _bare(wrapped)
    assert bare["scale"] < INIT_SCALE and bare["opt_steps"] < STEPS  # the scaler left some out
    guarded, _ = _guarded(tmp_path, wrapped)
    _same(guarded, bare)
    overflows = [e for e in read_events(tmp_path, 0) if e["kind"] == "overflow"]
    assert len(overflows) == STEPS - bare["opt_steps"]  # each one seen as the scaler's skip


@pytest.mark.parametrize("guard_steps", [False, True], ids=["check", "guard.step"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "accelerate"])
def test_a_nan_loss_is_left_out_and_lowers_the_scale_as_the_scalers_skip(
    tmp_path: Path, wrapped: bool, guard_steps: bool
) -> None:
    bare = _bare(wrapped, nan_at=8)  # the scaler leaves a NaN step out by itself
    guarded, guard = _guarded(tmp_path, wrapped, nan_at=8, guard_steps=guard_steps)
    _same(guarded, bare)
    assert list(guard.state.nonfinite_steps) == [8]


def test_an_accelerate_loop_that_steps_only_good_steps_is_told_and_trains(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``if guard.check(loss): optimizer.step()`` under accelerate: the scaler is not updated
    after a step left out (accelerate updates it inside ``step()``). Told once; the next step
    is unscaled anew and the scale backed off. Before: the stale overflow left every later
    step out too (the scale never went down) and the run never trained."""
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        guarded, guard = _guarded(tmp_path, wrapped=True, nan_at=8, always_step=False)
    told = [
        r.getMessage() for r in caplog.records if "GradScaler was not updated" in r.getMessage()
    ]
    assert len(told) == 1 and "docs/guard.md#accelerate" in told[0]
    bare = _bare(True, nan_at=8)
    assert guarded["opt_steps"] >= bare["opt_steps"] - 1  # one overflow more: the late back-off
    assert guarded["scale"] <= bare["scale"]
    assert list(guard.state.nonfinite_steps) == [8]
