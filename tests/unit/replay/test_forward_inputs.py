"""A NaN the loop makes between the fetch and the forward is named, not taken for a fault.

The loop normalizes each fetched batch by its own per-feature std (a common hand-written
transform); one batch has a constant feature, so ``(x - mean) / std`` divides 0 by 0. The
batch ``watch()`` handed out is finite, so the input check passes and the replay (which
starts from that batch) is finite: without the forward's own inputs the step would read as
a transient fault. With them:

- the bundle's meta holds ``forward_inputs`` (path, sample positions, the fetched batch
  finite) and the rank logs it at the capture;
- ``trainguard report`` says so under the capture, before any replay;
- the replay's verdict is ``input_made_in_loop`` with its advice, and no device is blamed;
- a NaN already in the fetched batch is the input check's (``in_fetched_batch`` true,
  verdict ``bad_input``); keyword inputs, later micro-batches and evaluation forwards inside
  a step are handled; a step started by ``record_batch`` has no forward inputs to compare.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tg_replay_cases import guarded_loop, normalize
from torch import Tensor, nn

import trainguard as tg
from trainguard.capture.forward_inputs import describe, forward_findings, made_in_loop
from trainguard.replay.verdicts import ADVICE
from trainguard.report.summary import summarize
from trainguard.report.text import report_text

pytestmark = pytest.mark.timeout(60)

BAD_STEP = 3
STEPS = 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x)


def batches(constant_at: int | None, nan_at: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        if step == constant_at:
            x[:, 2] = 1.5  # a constant feature: its std is 0
        if step == nan_at:
            x[5, 1] = float("nan")
        yield x, y


def factory() -> tuple[nn.Module, Callable[[nn.Module, Any], Tensor]]:
    torch.manual_seed(0)
    return Net(), lambda model, batch: F.mse_loss(model(batch[0]), batch[1])


def train(
    run_dir: Path, constant_at: int | None, nan_at: int | None = None, keyword: bool = False
) -> list[bool]:
    model, _ = factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def forward(x: Tensor) -> Tensor:
        return model(x=normalize(x)) if keyword else model(normalize(x))

    return guarded_loop(model, opt, run_dir, batches(constant_at, nan_at), forward)


def test_a_nan_made_by_the_loops_transform_is_recorded_logged_and_diagnosed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        decisions = train(tmp_path, constant_at=BAD_STEP)
    assert decisions == [step != BAD_STEP for step in range(STEPS)]
    bundle = tmp_path / "captures" / f"step-{BAD_STEP:08d}"
    found = tg.load_bundle(bundle).meta(0)["forward_inputs"]
    assert found == {
        "nonfinite": [{"forward": 0, "path": "args[0]", "positions": list(range(8))}],
        "in_fetched_batch": False,
    }
    assert any(
        f"step {BAD_STEP} rank 0: the model's forward got non-finite input at args[0]" in r.message
        and "made in the loop between the fetch and the forward" in r.message
        for r in caplog.records
    )
    summary = summarize(tmp_path)  # trainguard report, before any replay
    assert summary.captures[0]["made_in_loop"] == [
        {"rank": 0, "where": f"args[0] (samples {list(range(8))})"}
    ]
    assert "rank 0's forward got non-finite input at args[0]" in report_text(summary)
    report = tg.replay(bundle, factory, repeats=2).to_dict()
    assert (report["reproduced"], report["verdict"]) == (False, "input_made_in_loop")
    assert report["advice"] == ADVICE["input_made_in_loop"]
    assert "the model's forward got non-finite input at args[0]" in report["summary"]
    assert "suspect" not in report["summary"]  # the loop's code, not a device


@pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0:UserWarning")  # bisection
def test_replayed_through_the_transform_the_step_reproduces(tmp_path: Path) -> None:
    """The advice's other way: the transform moved into the factory's loss_fn."""
    train(tmp_path, constant_at=BAD_STEP)
    bundle = tmp_path / "captures" / f"step-{BAD_STEP:08d}"

    def with_transform() -> tuple[nn.Module, Callable[[nn.Module, Any], Tensor]]:
        model, _ = factory()
        return model, lambda m, batch: F.mse_loss(m(normalize(batch[0])), batch[1])

    report = tg.replay(bundle, with_transform, repeats=1).to_dict()
    assert report["reproduced"] and report["op"] == "aten.div"


def test_a_nan_in_the_fetched_batch_stays_the_input_checks(tmp_path: Path) -> None:
    assert train(tmp_path, constant_at=None, nan_at=BAD_STEP)[BAD_STEP] is False
    bundle = tmp_path / "captures" / f"step-{BAD_STEP:08d}"
    found = tg.load_bundle(bundle).meta(0)["forward_inputs"]
    assert found["in_fetched_batch"] is True and not made_in_loop(found)
    assert tg.replay(bundle, factory, repeats=1).verdict == "bad_input"


def test_keyword_inputs_are_named_by_their_keyword(tmp_path: Path) -> None:
    train(tmp_path, constant_at=BAD_STEP, keyword=True)
    found = tg.load_bundle(tmp_path / "captures" / f"step-{BAD_STEP:08d}").meta(0)
    assert [e["path"] for e in found["forward_inputs"]["nonfinite"]] == ["kwargs['x']"]


def test_every_training_forward_of_the_step_is_kept_and_evaluation_forwards_are_not(
    tmp_path: Path,
) -> None:
    """Two micro-batches, the second one made non-finite by the loop, and an evaluation
    forward under no_grad in between (not a forward of the step)."""
    model, _ = factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = list(batches(None))
    with tg.Guard(model, opt, run_dir=tmp_path, accumulation_steps=2) as guard:
        stream = iter(guard.watch(data))
        for micro in range(2):
            x, y = next(stream)
            if micro == 1:
                x = x.clone()
                x[3, 0] = float("inf")  # made by the loop after the fetch
                with torch.no_grad():
                    model(torch.full((2, 4), float("nan")))  # an evaluation forward
            F.mse_loss(model(x), y).backward()
        guard.record_loss(torch.tensor(1.0))
        assert guard.check(torch.tensor(1.0)) is False
        inputs = guard._parts.step_start.forward_inputs(0)
        assert inputs is not None and len(inputs) == 2  # the no_grad forward is not one
    found = tg.load_bundle(tmp_path / "captures" / f"step-{0:08d}").meta(0)["forward_inputs"]
    assert found["nonfinite"] == [{"forward": 1, "path": "args[0]", "positions": [3]}]
    assert describe(found) == "args[0] (samples [3]) of forward 1"


def test_findings_rules() -> None:
    finite = (torch.ones(2, 3),)
    bad = (torch.tensor([[1.0, float("nan"), 0.0], [0.0, 0.0, 0.0]]),)
    assert forward_findings(None, []) is None
    assert forward_findings([(finite, {})], [finite]) is None  # nothing non-finite
    found = forward_findings([(bad, {})], [finite])
    assert found is not None and made_in_loop(found) and describe(found) == "args[0] (samples [0])"
    # No batch handed to the guard (a loop without watch() or record_batch): nothing tells
    # where the value came from, so it is not called the loop's.
    unknown = forward_findings([(bad, {})], [])
    assert unknown is not None and unknown["in_fetched_batch"] is None and not made_in_loop(unknown)


def test_a_loop_handing_batches_to_record_batch_is_covered_too(tmp_path: Path) -> None:
    """A loop without ``watch()`` hands each batch to ``record_batch`` (the step starts
    there, before the forward); the forward's inputs are still the step's."""
    model, _ = factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=tmp_path) as guard:
        for x, y in batches(constant_at=BAD_STEP):
            guard.record_batch((x, y))
            loss = F.mse_loss(model(normalize(x)), y)
            loss.backward()
            assert len(guard._parts.step_start.forward_inputs(guard.state.step) or []) == 1
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
        guard.close()
        assert guard._parts.step_start.forward_inputs(guard.state.step - 1) is None  # released
    meta = tg.load_bundle(tmp_path / "captures" / f"step-{BAD_STEP:08d}").meta(0)
    assert made_in_loop(meta["forward_inputs"])


def test_a_step_started_in_a_child_keeps_no_inputs(tmp_path: Path) -> None:
    """A loop that calls a child of the guarded module: the child's inputs may be
    activations (kept alive past the backward), so none are kept."""
    model, _ = factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=tmp_path) as guard:
        for x, y in guard.watch(list(batches(None))[:2]):
            F.mse_loss(model.lin(x), y).backward()
            assert guard._parts.step_start.started(guard.state.step)
            assert guard._parts.step_start.forward_inputs(guard.state.step) is None
            assert guard.check(torch.tensor(0.5))
            opt.zero_grad()


def test_the_sync_free_step_carries_the_forward_inputs_to_its_late_capture(
    tmp_path: Path,
) -> None:
    """``guard.step()`` with a fused optimizer reads a step's outcome a step late, after the
    next step's forward replaced the hook's inputs: the pending step holds its own."""
    model, _ = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with tg.Guard(model, opt, run_dir=tmp_path) as guard:
        assert guard._parts.sync_free is not None
        for x, y in guard.watch(batches(constant_at=BAD_STEP)):
            guard.step(F.mse_loss(model(normalize(x)), y))
    assert list(guard.state.nonfinite_steps) == [BAD_STEP]
    meta = tg.load_bundle(tmp_path / "captures" / f"step-{BAD_STEP:08d}").meta(0)
    assert made_in_loop(meta["forward_inputs"])
    assert meta["forward_inputs"]["nonfinite"][0]["path"] == "args[0]"


def test_a_compiled_model_keeps_its_inputs_from_the_wrappers_eager_hook(tmp_path: Path) -> None:
    """``torch.compile(model)``: dynamo traces the inner module's hook (the step already
    started in the wrapper's); the hook must not compare modules there (dynamo's mutation
    tracking failed on it), and the wrapper's hook, run eagerly, keeps the inputs."""
    model, _ = factory()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(constant_at=BAD_STEP)
    decisions = guarded_loop(compiled, opt, tmp_path, data, lambda x: compiled(normalize(x)))
    assert decisions == [step != BAD_STEP for step in range(STEPS)]
    meta = tg.load_bundle(tmp_path / "captures" / f"step-{BAD_STEP:08d}").meta(0)
    assert made_in_loop(meta["forward_inputs"])
