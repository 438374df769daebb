"""A NaN made after the loss ``trainguard run`` reads (``attach/backward_calls.py``): the
tensor the backward runs on, computed from that loss, decides the loss's finiteness; a
backward of anything else (a probe on the model's detached output) does not."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainguard as tg
from trainguard.attach.backward_calls import computed_from
from trainguard.attach.hooks import Attacher
from trainguard.attach.loss_inputs import _finite_or

BACKWARD = torch.autograd.backward


def _train(after: str, bad_step: int = 2) -> None:
    """Five steps of a linear model; at ``bad_step`` the NaN comes ``after`` the loss
    function: ``times`` (``loss * nan``), ``aux`` (``loss + 0.1 * aux``, the term NaN), or
    ``probe`` (a backward of a probe's loss on the detached output, after the step)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    probe = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        out = model(x)
        loss = F.mse_loss(out, y)
        bad = step == bad_step
        if after == "times" and bad:
            loss = loss * float("nan")
        elif after == "aux":
            aux = out.square().mean() * (float("nan") if bad else 1.0)
            loss = loss + 0.1 * aux
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        if after == "probe":
            probe_loss = F.mse_loss(probe(out.detach()), y) * (float("nan") if bad else 1.0)
            probe_loss.backward()  # type: ignore[no-untyped-call]
            probe.zero_grad()


def _bad(run_dir: Path) -> list[tuple[int, str]]:
    events = tg.read_events(run_dir, 0)
    return [(e["step"], e["where"]) for e in events if e["kind"] == "nonfinite"]


@pytest.mark.parametrize(("after", "step"), [("times", 0), ("times", 2), ("aux", 2)])
def test_a_nan_made_after_the_loss_makes_the_loss_bad(
    attached: Attacher, tmp_path: Path, after: str, step: int
) -> None:
    _train(after, bad_step=step)  # step 0: before the guard exists (its first step's record)
    assert attached.guard is not None and not attached.aside
    assert _bad(tmp_path) == [(step, "loss")]  # before: "grad", the loss read finite


def test_a_probes_own_nan_is_not_the_models_step(attached: Attacher, tmp_path: Path) -> None:
    _train("probe")
    assert attached.guard is not None
    assert _bad(tmp_path) == []  # the model's step is fine: its loss and gradients finite


def test_the_wrapper_leaves_with_the_guard(attached: Attacher) -> None:
    assert torch.autograd.backward is not BACKWARD
    _train("times", bad_step=-1)
    attached.close()
    assert torch.autograd.backward is BACKWARD


def test_computed_from_walks_a_few_nodes_back() -> None:
    x = torch.ones(3, requires_grad=True)
    loss = x.square().mean()
    node: Any = loss.grad_fn
    assert computed_from((loss + 1) / 2, node)
    assert not computed_from(x.sum(), node)
    far = loss
    for _ in range(8):
        far = far * 1.0
    assert not computed_from(far, node)  # past the bound: not followed


def test_only_a_non_finite_backward_tensor_changes_the_loss() -> None:
    loss = torch.tensor(1.5)
    assert torch.isnan(_finite_or(loss, torch.tensor(float("nan"))))  # type: ignore[arg-type]
    assert torch.isinf(_finite_or(loss, torch.tensor(float("inf"))))  # type: ignore[arg-type]
    assert torch.equal(_finite_or(loss, torch.tensor(3e38)), loss)  # type: ignore[arg-type]
    assert _finite_or(None, torch.tensor(float("nan"))) is None


def test_a_step_left_out_before_its_backward_holds_no_graph(attached: Attacher) -> None:
    """The loss's autograd node is what the backward's tensor is compared with; held past
    the step, it held the step's activations: a loop that leaves a step out before its
    backward (its own rule) kept them through its next forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[Any] = []
    model[1].register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))
    for step in range(4):
        loss = F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 1))
        if step == 2:  # the loop's own rule: no backward, no update
            del loss
            continue
        if step == 3:
            gc.collect()
            assert seen[2]() is None  # step 2's activation, freed by step 3's forward
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    assert attached.guard is not None
