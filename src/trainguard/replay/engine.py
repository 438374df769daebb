"""The diagnosis engine shared by the bundle replay (runner.py) and the live trace (live.py).

From the runs of a step to a :class:`ReplayReport`: is it reproduced and deterministic, the
traced finding (phase, root op, NaN-maker, path, roots), the culprit samples by bisection,
the verdict with its advice, and one summary sentence. A step replayed under float16 or
bfloat16 autocast is run once more in float32: reproduced under autocast only, it is an
overflow of that dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from trainguard.capture import batchtree
from trainguard.capture.forward_inputs import made_in_loop
from trainguard.replay.autocast import OFF, any_autocast
from trainguard.replay.bisect import find_culprits
from trainguard.replay.chain import path_of, roots_of
from trainguard.replay.diagnosis import (
    Finding,
    entry_text,
    locate,
    made_in_loop_summary,
    not_reproduced_summary,
    recorded_loss_runs,
    spike_summary,
    step_loss,
    unread_culprits,
    unread_input_verdict,
)
from trainguard.replay.divergence import Growth, Runaway, growth, runaway
from trainguard.replay.optimizer import OptimizerView
from trainguard.replay.report import ReplayReport
from trainguard.replay.sentences import summarize
from trainguard.replay.stepper import RunResult, StepRunner
from trainguard.replay.verdicts import (
    ADVICE,
    SPIKE_NOT_REPRODUCED_ADVICE,
    classify,
    verdict_sentence,
)
from trainguard.replay.weights import weights_evidence
from trainguard.replay.writer import pending_summary


@dataclass
class Culprits:
    samples: list[dict[str, Any]] = field(default_factory=list)
    """``{"micro_batch", "position", "index"}`` per culprit (index: dataset index or None)."""
    batch_level: bool = False
    complete: bool = True
    runs: int = 0
    batch_size: int | None = None
    """The size of the (last) bisected micro-batch."""
    searched: bool = True
    """False: no bisection ran (``bisect=False``, or the whole step is to blame)."""
    unsearched: str = "no bisection"
    """Why no bisection ran, as the report says it (``searched`` False)."""
    every_alone: bool = False
    """Batch-level because the samples tried were each bad alone (``Bisection.every_alone``)."""


def diagnose_runs(
    runner: StepRunner,
    runs: list[RunResult],
    meta: dict[str, Any],
    device: str,
    bisect: bool,
    history: list[dict[str, Any]] | None = None,
    spike: bool = False,
    optimizer: OptimizerSource = None,
) -> ReplayReport:
    """Diagnose a step from ``runs`` (repeats of it) and further runs of ``runner``;
    ``spike``: the bundle is a spike's (a finite step the spike rule skipped);
    ``optimizer``: the optimizer's param groups and state (non-finite hyper-parameters, and
    what wrote non-finite weights), or a function that loads them (called only when a
    finding needs them: a bundle's optimizer state can be large)."""
    bad = [r for r in runs if r.bad]
    deterministic = len({r.bits for r in runs}) == 1
    replayed = {
        "nonfinite_runs": len(bad),
        "replayed": {
            "losses": runs[0].losses,
            "grad_norm": runs[0].grad_norm,
            "nonfinite_params": runs[0].bad_params,
        },
    }
    if not bad:
        wanted = isinstance(optimizer, OptimizerView) or bool(meta.get("hyperparameters"))
        view = _view(optimizer) if wanted else None  # the guard stopped it for one
        context = _Finite(meta, device, deterministic, spike, view, history)
        report = finite_report(runner, runs, context)
        report.details.update(replayed)
        return report
    micro = bad[0].first_bad_micro or 0
    finding = locate(runner, micro)
    if finding.parameter_origins:
        finding.weights = weights_evidence(
            finding.parameter_origins,
            finding.hop,
            finding.reader_samples,
            finding.batch_size,
            runner.model,
            _view(optimizer),
            history,
            _step(meta, history),
        )
    float32 = float32_reproduces(runner)
    only_half = runner.autocast.half if float32 is False else None
    grew = growth(history)
    ran_away = None if finding.parameter_origins else runaway(history, largest_weight(runner.model))
    some_read = finding.weights is not None and finding.weights.sample_specific
    diverged = grew is not None or ran_away is not None
    # the batch itself non-finite is its samples' doing, however the run went before it
    whole_step = finding.phase != "inputs" and (
        diverged or (bool(finding.parameter_origins) and not some_read)
    )
    if whole_step:  # the weights or the run's course, not a sample: nothing to bisect for
        culprits = Culprits(searched=False, unsearched="the cause is not a sample's")
    else:
        recorded = meta.get("dataset_indices")
        culprits = _culprits(runner, finding, recorded) if bisect else Culprits(searched=False)
    report = report_of(finding, culprits, deterministic, grew, only_half, ran_away)
    if len(bad) < len(runs):
        report.summary += f" (Non-finite in {len(bad)} of {len(runs)} replays: nondeterministic.)"
    report.details.update(replayed, bisection_runs=culprits.runs, float32_reproduced=float32)
    return report


OptimizerSource = OptimizerView | Callable[[], OptimizerView | None] | None
"""The optimizer's view, or a function that loads it (``diagnose_runs``)."""


def _view(source: OptimizerSource) -> OptimizerView | None:
    return source() if callable(source) else source


@dataclass
class _Finite:
    """What a finite replay's verdict reads besides the runs."""

    meta: dict[str, Any]
    device: str
    deterministic: bool
    spike: bool
    optimizer: OptimizerView | None
    history: list[dict[str, Any]] | None


def finite_report(runner: StepRunner, runs: list[RunResult], ctx: _Finite) -> ReplayReport:
    """The report of a step whose replays are all finite: a spike that recurs, a non-finite
    hyper-parameter the guard stopped the step for, values in the batch the loss does not
    read, a value the loop made, or a fault from outside the step."""
    meta, device, deterministic = ctx.meta, ctx.device, ctx.deterministic
    verdict, phase = "not_reproduced", None
    unread = batchtree.nonfinite_tensors(runner.micro_batches)
    hypers = ctx.optimizer.nonfinite() if ctx.optimizer is not None else []
    if ctx.spike:
        verdict, summary = spike_summary(runs, deterministic, device, meta)
    elif hypers and ctx.optimizer is not None:  # the guard's hyper-parameter check stopped it
        verdict, phase = "nonfinite_hyperparameter", "optimizer"
        step = _step(meta, ctx.history)
        summary = pending_summary(hypers, ctx.optimizer, step, ctx.history) + (
            f" The step's own forward and backward are finite ({len(runs)} replays on "
            f"{device}, loss {step_loss(runs):.6g}, finite gradients)."
        )
    elif unread:  # values the loss never reads (input check) or now handles (a fix)
        verdict, summary = unread_input_verdict(runs, unread, device, meta)
    elif deterministic and made_in_loop(meta.get("forward_inputs")):
        verdict, summary = "input_made_in_loop", made_in_loop_summary(runs, device, meta)
    else:
        summary = not_reproduced_summary(runs, deterministic, device, meta)
    reproduced = verdict == "spike"  # the spike's loss again
    culprits = unread_culprits([e for e in unread if not e.get("additive_mask")])
    report = ReplayReport(
        reproduced, deterministic, phase, None, None, None, culprits, verdict, summary
    )
    report.advice = ADVICE[verdict]
    report.details.update(**finding_details(None), bisection_runs=0)
    report.details["batch_nonfinite"] = [entry_text(e) for e in unread]
    report.details["hyperparameters"] = [h.to_dict() for h in hypers]
    if ctx.spike:  # finite when it ran: "not reproduced" is no transient fault here
        report.details["recorded_loss_runs"] = recorded_loss_runs(runs, meta)
        report.advice = SPIKE_NOT_REPRODUCED_ADVICE if not reproduced else report.advice
    return report


def _step(meta: dict[str, Any], history: list[dict[str, Any]] | None) -> int | None:
    """The replayed step's number: the rank's ``meta.json``, else the history's last record."""
    step = meta.get("step")
    if isinstance(step, int):
        return step
    last = history[-1].get("step") if history else None
    return last if isinstance(last, int) else None


def float32_reproduces(runner: StepRunner) -> bool | None:
    """Under float16 / bfloat16 autocast: is the step non-finite in float32 too (one more
    run without autocast)? None when the runner uses no such autocast, or when that run is
    no float32 run: a module was called under autocast anyway (``loss_fn`` or the model
    enters it itself, which the replay cannot turn off)."""
    if runner.autocast.half is None:
        return None
    seen: list[bool] = []

    def note(module: nn.Module, args: Any) -> None:
        if not seen and any_autocast(runner.device.type):
            seen.append(True)

    handle = register_module_forward_pre_hook(note)
    try:
        with runner.autocast_as(OFF):
            bad = runner.run().bad
    finally:
        handle.remove()
    return None if seen else bad


def report_of(
    finding: Finding,
    culprits: Culprits,
    deterministic: bool,
    grew: Growth | None,
    only_half: str | None = None,
    ran_away: Runaway | None = None,
) -> ReplayReport:
    """The report of a reproduced, traced step (``only_half``: the autocast dtype the step
    is non-finite under while finite in float32; ``ran_away``: the updates before it ran
    away)."""
    batch_level = culprits.batch_level and not culprits.samples
    verdict = classify(finding, batch_level, grew, culprits.batch_size, only_half, ran_away)
    lead = verdict_sentence(verdict, finding, grew, only_half, ran_away)
    every = batch_level and culprits.every_alone and verdict != "batch_statistics"
    complete = culprits.complete if culprits.searched else None
    summary = summarize(
        finding, culprits.samples, batch_level, complete, every, culprits.unsearched
    )
    report = ReplayReport(
        True,
        deterministic,
        finding.phase,
        finding.op,
        finding.module,
        finding.source,
        culprits.samples,
        verdict,
        f"{lead} {summary}" if lead else summary,
        nan_op=finding.nan_op,
        advice=ADVICE[verdict],
        path=path_of(finding.hop),
        roots=roots_of(finding.hop, finding.origin),
    )
    report.details.update(
        finding_details(finding),
        bisected=culprits.searched,
        unsearched=None if culprits.searched else culprits.unsearched,
        batch_level=batch_level,
        every_sample_bad=every,
        weights=finding.weights.to_dict() if finding.weights is not None else None,
        named_samples=finding.named_samples,
    )
    if grew is not None:
        report.details["growth"] = grew.to_dict()
    if ran_away is not None:
        report.details["runaway"] = ran_away.to_dict()
    return report


def largest_weight(model: nn.Module) -> tuple[str, float] | None:
    """The largest finite |value| among the model's floating-point parameters and its name
    (the weights before the step, as the bundle holds them); None without any."""
    best: tuple[str, float] | None = None
    for name, param in model.named_parameters():
        if not param.is_floating_point() or param.numel() == 0:
            continue
        values = param.detach().abs()
        finite = values[values.isfinite()]
        if finite.numel() == 0:
            continue
        top = float(finite.max())
        if best is None or top > best[1]:
            best = (name, top)
    return best


def finding_details(finding: Finding | None) -> dict[str, Any]:
    origin = finding.origin if finding is not None else None
    site = finding.site if finding is not None else None
    maker = finding.nan_maker if finding is not None else None
    backward = None
    if site is not None and site.phase == "backward":
        forward = site.forward
        backward = {
            "op": site.op,
            "grad_fn": site.grad_fn,
            "forward_op": forward.op if forward else None,
            "forward_module": forward.module if forward else None,
            "forward_source": forward.source if forward else None,
        }
    return {
        "op_detail": origin.detail if origin else None,
        "origin": origin.kind if origin else None,
        "code": site.code if site else None,
        "backward": backward,
        "nan_op_detail": maker.detail if maker else None,
        "nan_op_module": maker.site.module if maker and maker.site else None,
        "nan_op_source": maker.site.source if maker and maker.site else None,
        "batch_nonfinite": [o.detail for o in finding.input_origins] if finding else [],
        "weights_nonfinite": [o.label for o in finding.parameter_origins] if finding else [],
        "masked_row": _masked_row(finding),
        "masked_read": origin.masked_read.to_dict() if origin and origin.masked_read else None,
        "constant": origin.label if origin and origin.kind == "external" else None,
        "gradient_op": _gradient_op(finding),
    }


def _gradient_op(finding: Finding | None) -> dict[str, Any] | None:
    """A forward value the loss never read: the backward op where the gradient went
    non-finite."""
    entry = finding.backward_entry if finding is not None else None
    site = entry.site if entry is not None else None
    if site is None:
        return None
    forward = site.forward
    return {
        "op": site.op,
        "grad_fn": site.grad_fn,
        "forward_op": forward.op if forward else None,
        "module": site.module,
        "source": site.source,
        "value": entry.value if entry is not None else None,
    }


def _masked_row(finding: Finding | None) -> dict[str, Any] | None:
    row = finding.origin.masked_row if finding is not None and finding.origin else None
    if finding is None or row is None:
        return None
    return {**row.to_dict(), "sample": finding.masked_sample}


def _culprits(
    runner: StepRunner, finding: Finding, recorded: list[list[int] | None] | None = None
) -> Culprits:
    """Bisect every micro-batch that is bad on its own; positions plus dataset indices (the
    batch's own index field, else ``recorded``: ``meta.json``'s per micro-batch, which holds
    what the ``DataLoader``'s sampler drew)."""
    backward = finding.phase == "backward" or finding.loss_finite  # bad gradients only
    micros = range(len(runner.micro_batches))
    bad_micros = [
        m for m in micros if len(micros) == 1 or runner.run(micro=m, backward=backward).bad
    ]
    out = Culprits(runs=len(micros) if len(micros) > 1 else 0)
    for m in bad_micros:
        batch = runner.micro_batches[m]
        size = batchtree.batch_size(batch)
        out.batch_size = size
        if not size:
            out.batch_level = True
            continue
        indices = batchtree.dataset_indices(batch)
        if indices is None and recorded is not None and m < len(recorded):
            indices = recorded[m]

        def bad(positions: Any, m: int = m) -> bool | None:
            with warnings.catch_warnings():  # the loss's own warnings about a sub-batch the
                warnings.simplefilter("ignore")  # search made up (std of one sample...)
                result = runner.run(micro=m, positions=positions, backward=backward)
            return None if result.error is not None else result.bad

        found = find_culprits(bad, size)
        out.runs += found.runs
        out.batch_level |= found.batch_level
        out.every_alone |= found.every_alone
        out.complete &= found.complete
        for position in found.culprits:
            index = indices[position] if indices is not None and position < len(indices) else None
            out.samples.append({"micro_batch": m, "position": position, "index": index})
    out.batch_level &= not out.samples
    return out
