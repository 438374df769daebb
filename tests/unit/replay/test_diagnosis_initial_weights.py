"""Weights non-finite before the run's first update are named as such, not as "corrupted by an
earlier silent update": PyTorch's FSDP2 example builds its Transformer on the meta device,
materializes it with ``to_empty()`` and calls a ``reset_parameters()`` that forgets its
layers, so on a CPU the layers hold uninitialized memory and the first step is NaN. Each case
is a guarded run, replayed from its bundle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import trainguard as tg
from trainguard.replay.writer import find_writer

pytestmark = pytest.mark.timeout(120)

Batch = tuple[Tensor, Tensor]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(torch.relu(self.body(x)))
        return out

    def reset_parameters(self) -> None:
        self.head.reset_parameters()  # forgets ``body``, as the FSDP2 example forgets its layers


def _materialized() -> Net:
    """Built on the meta device and materialized; ``body`` is left as ``to_empty()`` made it
    (arbitrary memory: NaN here, so that the test does not depend on what it held)."""
    with torch.device("meta"):
        model = Net()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    with torch.no_grad():
        model.body.weight.fill_(float("nan"))
        model.body.bias.zero_()
    return model


def _loss(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _factory() -> tuple[nn.Module, Callable[[nn.Module, Batch], Tensor]]:
    return Net(), _loss


def _run(run_dir: Path, model: nn.Module, corrupt_at: int | None = None) -> list[Path]:
    """Six steps of SGD (``corrupt_at``: a NaN written into ``body.weight`` out of band
    before that step); the bundles the guard captured."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(6)]
    guard = tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0, max_consecutive=100)
    for step, batch in enumerate(guard.watch(data)):
        if step == corrupt_at:
            with torch.no_grad():
                model.body.weight[0, 0] = float("nan")  # type: ignore[index]
        loss = _loss(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        if guard.check(loss):
            opt.step()
        opt.zero_grad()
    guard.close()
    return sorted((run_dir / "captures").iterdir())


def _replay(bundle: Path) -> dict[str, Any]:
    report: dict[str, Any] = tg.replay(bundle, _factory).to_dict()
    return report


def test_weights_never_initialized_are_named_before_the_first_update(tmp_path: Path) -> None:
    bundles = _run(tmp_path, _materialized())
    r = _replay(bundles[0])
    assert r["step"] == 0 and r["verdict"] == "nonfinite_initial_weights"
    assert r["summary"].startswith(
        "Non-finite weights before the run's first update: body.weight. No update of this run "
        "wrote them (the history runs from step 0 and none before this step was applied): they "
        "were non-finite when training began, made by the model's initialization or by the "
        "weights the script loaded (or by steps taken before the guard was)."
    )
    assert "to_empty()" in r["advice"] and "reset_parameters()" in r["advice"]
    assert r["weights"]["writer"]["before_any_update"] is True
    assert "verdict        nonfinite_initial_weights" in str(tg.replay(bundles[0], _factory))


def test_weights_corrupted_after_applied_updates_are_not_called_initial(tmp_path: Path) -> None:
    """Three updates applied, then a NaN written out of band: the weights were finite when
    training began, so the verdict is the plain one, naming the update before the step."""
    torch.manual_seed(0)
    model = Net()
    (bundle,) = _run(tmp_path, model, corrupt_at=3)[:1]
    r = _replay(bundle)
    assert r["step"] == 3 and r["verdict"] == "nonfinite_weights"
    assert r["weights"]["writer"]["before_any_update"] is False
    assert r["summary"].startswith("Non-finite weights before the step: body.weight.")


def test_only_a_history_from_step_0_without_a_gap_says_no_update_came() -> None:
    """A history that starts later (a bounded one, a resume) or has a gap may hide an applied
    update: then the verdict stays the plain one."""

    def before_any(steps: list[int], step: int, decision: str = "skip") -> bool:
        history = [{"step": s, "decision": decision, "grad_norm": "inf"} for s in steps]
        return find_writer(["w"], {"w": (2,)}, step, history, None).before_any_update

    assert before_any([0, 1, 2, 3], 4) and before_any([], 0)
    assert not before_any([0, 1, 2], 10)  # steps 3..9 unknown
    assert not before_any([5, 6, 7], 8)  # a history that starts later
    assert not before_any([0, 1, 2, 3], 4, decision="ok")  # updates were applied
