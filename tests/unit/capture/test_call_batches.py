"""A loop that neither iterates ``guard.watch()`` nor calls ``guard.record_batch()`` still
gets its bad step's micro-batches in the bundle: the guarded model's call arguments
(nanoGPT's ``model(X, Y)`` gives ``(X, Y)``), one per training forward, so ``trainguard
replay`` can rerun the step. A loop that refills one input buffer in place has the
micro-batches written since their forward listed as overwritten, never passed off as
theirs; ``watch()``'s and ``record_batch()``'s batches stay what the bundle holds."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import trainguard as tg

pytestmark = pytest.mark.timeout(60)

BAD_STEP, STEPS, MICRO = 3, 5, 2


class LossModel(nn.Module):
    """nanoGPT's shape: ``model(x, y)`` returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(self.lin(x), y)


def make_replay() -> tuple[nn.Module, object]:
    return LossModel(), lambda model, batch: model(*batch)


def micro_batches() -> Iterator[tuple[int, int, Tensor, Tensor]]:
    for step in range(STEPS):
        for micro in range(MICRO):
            gen = torch.Generator().manual_seed(10 * step + micro)
            x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
            if (step, micro) == (BAD_STEP, 1):
                x[5, 1] = float("nan")
            yield step, micro, x, y


def _accumulate(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    run_dir: Path,
    feed: Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]],
) -> tg.Guard:
    """A check()-only loop, ``MICRO`` micro-batches a step, the model called with what
    ``feed(step, x, y)`` gives (no ``watch()``, no ``record_batch()``)."""
    with tg.Guard(model, opt, run_dir=run_dir) as guard:
        for step, micro, x, y in micro_batches():
            loss = model(*feed(step, x, y)) / MICRO
            loss.backward()
            if micro == MICRO - 1:
                if guard.check(loss):
                    opt.step()
                opt.zero_grad()
    return guard


def _bundle(run_dir: Path) -> tg.Bundle:
    return tg.load_bundle(run_dir / "captures" / f"step-{BAD_STEP:08d}")


def test_the_model_call_arguments_are_the_bundles_micro_batches(tmp_path: Path) -> None:
    model = LossModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fed: list[tuple[Tensor, Tensor]] = []

    def feed(step: int, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        fed.extend([(x, y)] if step == BAD_STEP else [])
        return x, y

    guard = _accumulate(model, opt, tmp_path, feed)
    assert list(guard.state.nonfinite_steps) == [BAD_STEP]
    bundle = _bundle(tmp_path)
    stored = bundle.batches(0)
    assert len(stored) == MICRO
    for (x, y), (sx, sy) in zip(fed, stored, strict=True):
        assert torch.equal(x.nan_to_num(7.0), sx.nan_to_num(7.0)) and torch.equal(y, sy)
    assert "overwritten_micro_batches" not in bundle.meta(0)
    report = tg.replay(bundle.path, make_replay).to_dict()
    assert (report["reproduced"], report["verdict"]) == (True, "bad_input")


def test_a_refilled_input_buffer_is_listed_as_overwritten(tmp_path: Path) -> None:
    """The loop copies each micro-batch into one buffer: when the step is decided, the first
    micro-batch's tensors hold the second's data."""
    model = LossModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xbuf, ybuf = torch.empty(8, 4), torch.empty(8, 1)
    _accumulate(model, opt, tmp_path, lambda _, x, y: (xbuf.copy_(x), ybuf.copy_(y)))
    assert _bundle(tmp_path).meta(0)["overwritten_micro_batches"] == [0]


def test_the_sync_free_step_keeps_the_call_arguments_to_its_late_capture(
    tmp_path: Path,
) -> None:
    model = LossModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    fed: list[Tensor] = []
    with tg.Guard(model, opt, run_dir=tmp_path) as guard:
        for step, micro, x, y in micro_batches():
            if micro:
                continue  # one micro-batch a step
            fed += [x] if step == BAD_STEP else []
            if step == BAD_STEP:
                x[5, 1] = float("nan")
            guard.step(model(x, y))
    assert list(guard.state.nonfinite_steps) == [BAD_STEP]
    ((sx, _),) = _bundle(tmp_path).batches(0)
    assert sx is not fed[0] and torch.equal(sx.isnan(), fed[0].isnan())


def test_watched_batches_stay_what_the_bundle_holds(tmp_path: Path) -> None:
    model = LossModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(x, y) for _, micro, x, y in micro_batches() if micro == 1]
    with tg.Guard(model, opt, run_dir=tmp_path) as guard:
        for x, y in guard.watch(loader):
            loss = model(x, y)
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    (stored,) = _bundle(tmp_path).batches(0)
    assert isinstance(stored, (list, tuple)) and torch.equal(stored[1], loader[BAD_STEP][1])


def test_an_input_made_in_inference_mode_trains_as_it_does_bare(tmp_path: Path) -> None:
    """An inference tensor keeps no version counter (reading it raises): a forward that
    takes one without saving it for backward trains guarded as bare."""

    class Shift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(4))

        def forward(self, x: Tensor) -> Tensor:
            return (self.bias + x).square().mean()

    model = Shift()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.inference_mode():
        data = [torch.randn(8, 4) for _ in range(3)]
    with tg.Guard(model, opt, run_dir=tmp_path) as guard:
        for x in data:
            loss = model(x)
            loss.backward()
            assert guard.check(loss)
            opt.step()
            opt.zero_grad()
    assert guard.state.step == 3
