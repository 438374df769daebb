"""A learning-rate blow-up is divergence, named by its learning rate and its weights (issue 53,
item 12): the replay once called nanoGPT at lr 1e10 ``numerical`` and a jumped LR "the batch as
a whole". Each case is a guarded run, replayed from its bundle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import trainguard as tg
from trainguard.replay.divergence import RUNAWAY_WEIGHT, runaway

pytestmark = pytest.mark.timeout(120)

Batch = tuple[Tensor, Tensor]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.LayerNorm(32),
        nn.GELU(),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, 1),
    )


def _loss(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _factory() -> tuple[nn.Module, Callable[[nn.Module, Batch], Tensor]]:
    return _model(), _loss


def _run(run_dir: Path, lr_at: Callable[[int], float]) -> Path:
    """SGD with ``lr_at(step)``; the first bundle the guard captured."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr_at(0))
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(12)
    ]
    guard = tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0, max_consecutive=100)
    for step, batch in enumerate(guard.watch(data)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = _loss(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        if guard.check(loss):
            opt.step()
        opt.zero_grad()
    guard.close()
    return sorted((run_dir / "captures").iterdir())[0]


def _replay(bundle: Path) -> dict[str, Any]:
    report: dict[str, Any] = tg.replay(bundle, _factory).to_dict()
    return report


def test_a_jumped_learning_rate_is_divergence_named_by_the_jump_and_the_weights(
    tmp_path: Path,
) -> None:
    bundle = _run(tmp_path, lambda step: 1e10 if step >= 5 else 1e-2)
    r = _replay(bundle)
    assert r["verdict"] == "divergence"
    assert r["summary"].startswith(
        "The run diverged: the learning rate jumped 1e+12x at step 5 (from 0.01 to 1e+10) and "
        "the weights reached |w| = "
    )
    ran = r["runaway"]
    assert (ran["lr"], ran["lr_before"], ran["jump_step"]) == (1e10, 1e-2, 5)
    assert ran["largest_weight"] >= RUNAWAY_WEIGHT and ran["param"]
    assert "lower the learning rate" in r["advice"]
    assert r["culprit_samples"] == []  # no sample is blamed for a whole-run cause
    # and the report says why none was looked for (not "no bisection": bisect was on)
    assert (r["bisected"], r["unsearched"]) == (False, "the cause is not a sample's")
    assert "not searched for (the cause is not a sample's)" in r["summary"]


def test_an_absurd_learning_rate_from_the_start_is_divergence_too(tmp_path: Path) -> None:
    """No jump and too short a history to grow: the weights themselves say it."""
    bundle = _run(tmp_path, lambda step: 1e10)
    r = _replay(bundle)
    assert r["verdict"] == "divergence"
    assert r["summary"].startswith("The run diverged: the learning rate was 1e+10 and the weights")
    assert r["runaway"]["lr_before"] is None
    assert r["unsearched"] == "the cause is not a sample's"


def test_a_warm_up_is_no_jump_and_trained_weights_are_no_runaway() -> None:
    warm = [{"step": s, "lr": 1e-4 * (s + 1), "grad_norm": 1.0, "losses": [1.0]} for s in range(8)]
    bad = {"step": 8, "lr": 9e-4, "grad_norm": "nan", "losses": ["nan"]}
    assert runaway([*warm, bad], ("head.weight", 3.5)) is None
    jumped = [*warm[:-1], {**warm[-1], "lr": 0.5}, bad]
    found = runaway(jumped, ("head.weight", 3.5))
    assert found is not None and (found.jump_step, found.weight) == (7, None)
    assert runaway([bad], ("w", 2 * RUNAWAY_WEIGHT)) is not None  # weights alone say it
