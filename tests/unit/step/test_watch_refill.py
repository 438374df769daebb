"""``watch()`` over an iterable that refills the same tensors (a DALI-style loader, a staging
buffer): the guard's fetch ahead must not change what the loop trains on. The loop sees the
batches the bare loop sees, in order, with gradient accumulation too, and a NaN batch is
captured as itself; an iterable of fresh tensors (or one batch repeated) is not copied past
the first batches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import trainguard as tg
from trainguard.capture.bundle import load_bundle


def refilling(count: int, nan_at: int = -1) -> Iterator[tuple[Tensor, Tensor]]:
    """Yields the same two tensors, refilled in place: batch i is all i (a NaN at nan_at)."""
    x, y = torch.empty(2, 3), torch.empty(2, 1)
    for i in range(count):
        x.fill_(float(i))
        y.fill_(float(-i))
        if i == nan_at:
            x[1, 2] = float("nan")
        yield x, y


def fresh(count: int) -> Iterator[tuple[Tensor, Tensor]]:
    for i in range(count):
        yield torch.full((2, 3), float(i)), torch.full((2, 1), float(-i))


def _seen(tmp_path: Path, batches: Iterator[tuple[Tensor, Tensor]], k: int) -> list[float]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    config = tg.GuardConfig(run_dir=tmp_path, hang_timeout=0, accumulation_steps=k)
    with tg.Guard(model, opt, config=config) as guard:
        for micro, (x, y) in enumerate(guard.watch(batches)):
            seen.append(float(x[0, 0]))
            loss = (model(x) - y).square().mean() / k
            loss.backward()  # type: ignore[no-untyped-call]
            if micro % k == k - 1:
                guard.step(loss)
    return seen


@pytest.mark.parametrize("k", [1, 3])
def test_the_loop_trains_on_the_batches_a_refilling_iterable_gave(tmp_path: Path, k: int) -> None:
    assert _seen(tmp_path, refilling(12), k) == [float(i) for i in range(12)]
    kinds = [e["kind"] for e in tg.read_events(tmp_path, 0)]
    assert kinds.count("refilled_batches") == 1


def test_a_nan_batch_of_a_refilling_iterable_is_captured_as_itself(tmp_path: Path) -> None:
    seen = _seen(tmp_path, refilling(8, nan_at=5), 1)
    assert seen == [float(i) for i in range(8)]
    ((x, y),) = load_bundle(tmp_path / "captures" / "step-00000005").batches(0)
    assert torch.isnan(x[1, 2]) and float(x[0, 0]) == 5.0 and float(y[0, 0]) == -5.0


def test_fresh_tensors_and_a_repeated_batch_are_not_copied_past_the_probe(tmp_path: Path) -> None:
    batch = (torch.ones(2, 3), torch.ones(2, 1))
    for name, batches in (("fresh", fresh(20)), ("repeated", iter([batch] * 20))):
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        handed = []
        with tg.Guard(model, opt, run_dir=tmp_path / name, hang_timeout=0) as guard:
            for x, y in guard.watch(batches):
                handed.append(x)
                guard.step((model(x) - y).square().mean())
            assert guard._stream is not None and guard._stream._refills is None  # probe over
        events = tg.read_events(tmp_path / name, 0)
        assert not [e for e in events if e["kind"] == "refilled_batches"]
        if name == "repeated":
            assert handed[-1] is batch[0]  # handed out as it is once the probe ended
