"""``trainguard run`` checks a step before the script's gradient clip (attach/clip.py).

The wrappers are installed in this process and removed after each test; ``check`` stands for
the attacher's check (it records the gradients it saw, and may drop them, as a skip does).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn
from torch.nn import utils
from torch.nn.utils import clip_grad

from trainguard.attach.clip import CLIPPERS, ClipWatch

ORIGINALS = {
    (namespace.__name__, name): getattr(namespace, name)
    for namespace in (utils, clip_grad)
    for name in CLIPPERS
    if hasattr(namespace, name)  # clip_grads_with_norm_: torch.nn.utils only
}
SCALE = torch.amp.GradScaler.scale


class Checks:
    """The check the clip runs: the gradient norms it saw; drops them when ``skip``."""

    def __init__(self, model: nn.Module, skip: bool = False) -> None:
        self.model = model
        self.skip = skip
        self.seen: list[float] = []

    def __call__(self) -> None:
        self.seen.append(_norm(self.model))
        if self.skip:
            for p in self.model.parameters():
                p.grad = None


@pytest.fixture
def watch() -> Iterator[ClipWatch]:
    clip = ClipWatch()
    clip.install()
    try:
        yield clip
    finally:
        clip.remove()
    for (module, name), original in ORIGINALS.items():
        namespace = utils if module == utils.__name__ else clip_grad
        assert getattr(namespace, name) is original
    assert torch.amp.GradScaler.scale is SCALE


def _model_with_grads(scale: float = 100.0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    (model(torch.randn(16, 4)).sum() * scale).backward()  # type: ignore[no-untyped-call]
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _norm(model: nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))


def test_every_clipper_is_wrapped_under_both_names(watch: ClipWatch) -> None:
    for (module, name), original in ORIGINALS.items():
        namespace = utils if module == utils.__name__ else clip_grad
        wrapped = getattr(namespace, name)
        assert wrapped is not original and wrapped.__wrapped__ is original  # type: ignore[attr-defined]


def test_the_step_is_checked_once_before_the_clip(watch: ClipWatch) -> None:
    model, optimizer = _model_with_grads()
    checks = Checks(model)
    watch.attach(optimizer, checks)
    utils.clip_grad_norm_(model.parameters(), 1.0)  # before any forward: not a step's clip
    assert checks.seen == []
    model, optimizer = _model_with_grads()
    before = _norm(model)
    checks = Checks(model)
    watch.attach(optimizer, checks)
    watch.forward()
    total = utils.clip_grad_norm_(model.parameters(), 1.0)  # a generator of parameters
    assert checks.seen == [pytest.approx(before)] and before > 10
    assert float(total) == pytest.approx(before) and _norm(model) == pytest.approx(1.0)
    clip_grad.clip_grad_value_(list(model.parameters()), 0.01)  # the same step: no second
    assert len(checks.seen) == 1
    assert watch.take_checked() and not watch.take_checked()  # the optimizer step's answer
    watch.stepped()
    utils.clip_grad_norm_(model.parameters(), 1.0)  # after the step, before a forward
    assert len(checks.seen) == 1


def test_a_skip_leaves_the_clip_nothing_to_clip(watch: ClipWatch) -> None:
    model, optimizer = _model_with_grads()
    model[2].weight.grad[0, 0] = float("nan")  # type: ignore[index]
    watch.attach(optimizer, Checks(model, skip=True))
    watch.forward()
    # the script's own non-finite check would raise here; the skip came first
    total = utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    assert float(total) == 0.0 and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("as_generator", [False, True])
def test_a_skip_leaves_clip_grad_value_nothing_to_clip(
    watch: ClipWatch, as_generator: bool
) -> None:
    """torch's ``clip_grad_value_`` raises when no parameter has a gradient (2.13: "Expected
    !nested_tensorlist[0].empty()"): a script that clips by value must get past a skip."""
    model, optimizer = _model_with_grads()
    model[2].weight.grad[0, 0] = float("nan")  # type: ignore[index]
    watch.attach(optimizer, Checks(model, skip=True))
    watch.forward()
    params = model.parameters() if as_generator else list(model.parameters())
    assert utils.clip_grad_value_(params, 0.5) is None
    assert all(p.grad is None for p in model.parameters())


def test_no_check_in_a_closure_for_other_parameters_or_with_a_scaler(watch: ClipWatch) -> None:
    model, optimizer = _model_with_grads()
    other = nn.Linear(4, 1)
    other(torch.randn(2, 4)).sum().backward()  # type: ignore[no-untyped-call]
    checks = Checks(model)
    watch.attach(optimizer, checks)
    watch.forward()
    utils.clip_grad_norm_(other.parameters(), 1.0)  # not the guarded optimizer's
    watch.in_closure = True  # Lightning: checked when the closure returns, with its loss
    utils.clip_grad_norm_(model.parameters(), 1.0)
    watch.in_closure = False
    torch.amp.GradScaler("cpu", enabled=False).scale(torch.ones(()))  # a disabled scaler
    assert checks.seen == [] and not watch.scaled
    torch.amp.GradScaler("cpu").scale(torch.ones(()))  # fp16: overflows are the scaler's
    assert watch.scaled
    utils.clip_grad_norm_(model.parameters(), 1.0)
    assert checks.seen == []


def test_a_single_tensor_and_a_list_are_clipped_as_given(watch: ClipWatch) -> None:
    model, optimizer = _model_with_grads()
    checks = Checks(model)
    watch.attach(optimizer, checks)
    watch.forward()
    first: Tensor = next(iter(model.parameters()))
    assert first.grad is not None
    utils.clip_grads_with_norm_(first, 1.0, torch.tensor(1e6))
    assert len(checks.seen) == 1 and float(first.grad.abs().max()) < 1e-3


def test_removing_twice_and_after_a_rewrap_keeps_the_later_wrapper() -> None:
    watch = ClipWatch()
    watch.install()
    mine = utils.clip_grad_norm_
    try:
        utils.clip_grad_norm_ = lambda *a, **k: torch.zeros(())  # someone wraps it after us
        watch.remove()
        assert (
            utils.clip_grad_norm_ is not mine
            and utils.clip_grad_norm_ is not ORIGINALS[(utils.__name__, "clip_grad_norm_")]
        )
        watch.remove()
    finally:
        utils.clip_grad_norm_ = ORIGINALS[(utils.__name__, "clip_grad_norm_")]
    assert clip_grad.clip_grad_norm_ is ORIGINALS[(clip_grad.__name__, "clip_grad_norm_")]


def test_a_frozen_parameter_first_in_the_list_still_checks(watch: ClipWatch) -> None:
    model, _ = _model_with_grads()
    frozen = nn.Parameter(torch.zeros(3), requires_grad=False)  # an embedding kept fixed
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checks = Checks(model)
    watch.attach(optimizer, checks)
    watch.forward()
    utils.clip_grad_norm_([frozen, *model.parameters()], 1.0)
    assert len(checks.seen) == 1 and checks.seen[0] > 10


def test_a_clip_traced_by_torch_compile_is_left_to_the_optimizer_step(watch: ClipWatch) -> None:
    model, optimizer = _model_with_grads()
    checks = Checks(model)
    watch.attach(optimizer, checks)
    watch.forward()
    params = list(model.parameters())
    compiled = torch.compile(lambda: utils.clip_grad_norm_(params, 1.0), backend="eager")
    assert float(compiled()) > 10 and _norm(model) == pytest.approx(1.0)
    assert checks.seen == [] and not watch.take_checked()
