"""Diagnosis without a bundle: trace a live step, or re-run one, with the replay's engine.

::

    with tg.trace() as t:
        loss = loss_fn(model, batch)
        loss.backward()
    print(t.diagnose())              # a ReplayReport: fields, .to_dict(), str() is the text

    report = tg.diagnose(model, loss_fn, batch, bisect=True)

``trace`` watches the ops as they run (the tracer of the replay, with the backward phase
told by the autograd engine): the first model that runs is named from its outermost module,
its non-finite weights and inputs are tagged when it is called. ``diagnose`` re-runs
``loss_fn(model, batch)`` and backward on the live objects, like a replay of a bundle
(repeats, the traced run, the culprit samples by bisection when asked), and leaves the
model's weights, gradients, buffers and the RNG states as they were.
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn

from trainguard.capture import batchtree
from trainguard.capture.rng import rng_state, set_rng_state
from trainguard.errors import ReplayError
from trainguard.numerics import stored_values
from trainguard.replay.diagnosis import finding_of
from trainguard.replay.engine import Culprits, diagnose_runs, report_of
from trainguard.replay.localize import NonFiniteTracer, Origin
from trainguard.replay.optimizer import view_of_optimizer
from trainguard.replay.report import ReplayReport
from trainguard.replay.seeds import seed_inputs, seed_outside, seed_parameters
from trainguard.replay.sites import ModuleStack
from trainguard.replay.stepper import LossFn, RunResult, StepRunner


class Trace:
    """A context manager that traces the non-finite values of the code it wraps."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = model
        self.modules = ModuleStack(model, on_root=self._on_root)
        self.tracer = NonFiniteTracer(self.modules, auto_phase=True)
        self.modules.on_outside = lambda module: seed_outside(self.tracer, module)
        self.inputs: list[Origin] = []
        self.params: list[Origin] = []
        self._seeded: set[int] = set()
        self._loss: Tensor | None = None

    def __enter__(self) -> Trace:
        self.modules.__enter__()
        self.tracer.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.tracer.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
        self.modules.__exit__(exc_type, exc, tb)
        ref = self.tracer.last_forward or self.tracer.last_output
        self._loss = ref() if ref is not None else None

    def _on_root(self, module: nn.Module, args: Any) -> None:
        if id(module) not in self._seeded:
            self._seeded.add(id(module))
            self.params += seed_parameters(self.tracer, module)
        size = batchtree.batch_size(args)
        self.inputs += seed_inputs(self.tracer, args, batchtree.leaves, size, name="input")

    def diagnose(self, loss: Tensor | None = None) -> ReplayReport:
        """The report of the traced step. ``loss``: the step's loss (default: the output of
        the last op before ``backward()``, or of the last op traced)."""
        loss = loss if loss is not None else self._loss
        result = self._result(loss)
        parameters = [p for m in self.modules.roots for p in m.parameters() if p.requires_grad]
        finding = finding_of(result, self.tracer, self.inputs, self.params, parameters)
        if finding.phase is None:
            return _finite_report(result, "the traced step", _device_of(loss), 1)
        report = report_of(finding, Culprits(searched=False), True, None)
        report.details.update(device=_device_of(loss), repeats=1, nonfinite_runs=1)
        return report

    def _result(self, loss: Tensor | None) -> RunResult:
        result = RunResult(loss_tensor=loss)
        if loss is None:  # dropped: judge by what the tracer saw in the forward pass
            result.loss_finite = not (self.inputs or self.params or self.tracer.first("forward"))
        elif loss.numel():
            value = float(loss.detach().float().reshape(-1)[0])
            result.losses = [value]
            result.loss_finite = bool(torch.isfinite(loss.detach()).all())
        for root in self.modules.roots:
            for name, param in root.named_parameters():
                grad = param.grad
                if grad is not None and not bool(torch.isfinite(stored_values(grad)).all()):
                    result.bad_params.append(name)
        result.grads_finite = not result.bad_params
        return result


def trace(model: nn.Module | None = None) -> Trace:
    """Trace the step run in the ``with`` block; ``.diagnose()`` afterwards (module doc)."""
    return Trace(model)


def diagnose(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    *,
    bisect: bool = False,
    repeats: int = 2,
    history: list[dict[str, Any]] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> ReplayReport:
    """Re-run ``loss_fn(model, batch)`` and backward on the live objects and diagnose it.

    ``bisect``: search the culprit samples (more runs). ``history``: recent step records as
    in a bundle's ``history.json`` (``{"step", "losses", "grad_norm", "decision", "lr",
    "lrs"}``, the bad step last) to judge divergence and which update wrote non-finite
    weights. ``optimizer``: its param groups and state say which group holds such weights,
    whether a hyper-parameter is not finite, and whether rows were ever updated. The
    model's weights, gradients, buffers, training mode and the RNG states are left as they
    were.
    """
    if repeats < 1:
        raise ReplayError(f"repeats={repeats}: use 1 or more")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    grads = {p: p.grad for p in model.parameters()}
    saved_rng = rng_state()
    runner = StepRunner(model, loss_fn, [batch], saved_rng, device)
    view = view_of_optimizer(optimizer, model.named_parameters()) if optimizer else None
    try:
        runs = [runner.run(strict=True) for _ in range(repeats)]
        if not any(r.bad for r in runs) and not (view and view.nonfinite()):
            same = len({r.bits for r in runs}) == 1
            what = f"{repeats} runs of the step"
            return _finite_report(runs[0], what, str(device), repeats, same)
        meta = {"live": True}
        report = diagnose_runs(runner, runs, meta, str(device), bisect, history, False, view)
    finally:
        set_rng_state(saved_rng)
        runner.restore_buffers()
        for p, grad in grads.items():
            p.grad = grad
    report.details.update(device=str(device), repeats=repeats)
    return report


def _device_of(loss: Tensor | None) -> str:
    return str(loss.device) if isinstance(loss, Tensor) else "cpu"


def _finite_report(
    result: RunResult, what: str, device: str, repeats: int, deterministic: bool = True
) -> ReplayReport:
    loss = result.losses[0] if result.losses else math.nan
    summary = f"Nothing to diagnose: {what} gave a finite loss ({loss:.6g}) and finite gradients."
    report = ReplayReport(
        False, deterministic, None, None, None, None, [], "not_reproduced", summary
    )
    report.details.update(nonfinite_runs=0, device=device, repeats=repeats)
    return report
