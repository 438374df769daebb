"""The summary sentence of a reproduced step: what made it non-finite, where, and who is to
blame (the culprit samples, or the samples the finding itself names)."""

from __future__ import annotations

import os
from typing import Any

from trainguard.replay.diagnosis import Finding
from trainguard.replay.localize import Origin
from trainguard.replay.rows import spans
from trainguard.replay.sites import OpSite


def file_line(source: str | None) -> str:
    if not source:
        return "unknown line"
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}"


def where(site: OpSite) -> str:
    if site.module is None:
        return "loss_fn, outside any module"
    if not site.in_model:
        return f"{site.module} (a module outside the model)"
    return site.module


def culprit_text(
    culprits: list[dict[str, Any]],
    batch_level: bool,
    complete: bool | None = True,
    every: bool = False,
    named: list[int] | None = None,
    unsearched: str = "no bisection",
) -> str:
    """Who is to blame; ``complete`` None: no bisection ran (``unsearched``: why). ``named``:
    the samples the finding names (where the non-finite values sit): then no bisection that
    blames no single sample makes it "the batch as a whole"."""
    if not culprits:
        if named and (batch_level or every):
            noun = "sample" if len(named) == 1 else "samples"
            if every:
                return (
                    f"the non-finite values sit in {noun} {spans(named)}, and each sample tried "
                    "makes the step non-finite on its own"
                )
            return (
                f"the non-finite values sit in {noun} {spans(named)} (bisection singles out no "
                "sample: its culprits would be more than half of the batch, or bad only together)"
            )
        if every:
            return "every sample tried makes the step non-finite on its own"
        if batch_level:
            return "no single sample is to blame: the cause is the batch as a whole"
        if complete is None:
            return f"the samples to blame were not searched for ({unsearched})"
        if not complete:
            return "the samples to blame were not searched for to the end (bisection budget)"
        return "no sample was singled out"
    positions = ", ".join(
        str(c["position"])
        if c.get("micro_batch", 0) == 0
        else f"{c['position']} of micro-batch {c['micro_batch']}"
        for c in culprits
    )
    indices = [c["index"] for c in culprits if c.get("index") is not None]
    noun = "sample" if len(culprits) == 1 else "samples"
    extra = ""
    if indices:
        label = "index" if len(indices) == 1 else "indices"
        extra = f" (dataset {label} {', '.join(map(str, indices))})"
    verb = "alone makes" if len(culprits) == 1 else "make"
    return f"{noun} {positions} of the batch{extra} {verb} the step non-finite"


def summarize(
    finding: Finding,
    culprits: list[dict[str, Any]],
    batch_level: bool,
    complete: bool | None = True,
    every: bool = False,
    unsearched: str = "no bisection",
) -> str:
    origin, phase = finding.origin, finding.phase
    who = culprit_text(culprits, batch_level, complete, every, finding.named_samples, unsearched)
    if origin is None:
        what = {
            "inputs": "the batch holds non-finite values",
            "backward": "the forward pass was finite but the gradients were not",
        }.get(phase or "", f"the step went non-finite in the {phase} phase")
        return f"The step reproduced ({what}), but no single op could be named; {who}."
    if origin.kind == "input":
        return f"The batch itself is bad: {origin.detail}; {who}. Fix or filter the data."
    if origin.kind == "parameter":
        return _weights(finding, origin, who)
    if origin.kind == "external":
        return _external(finding, origin, who)
    site = origin.site
    if site is None:
        return f"The step reproduced ({origin.detail}); {who}."
    return _op_root(finding, origin, site, who)


def _weights(finding: Finding, origin: Origin, who: str) -> str:
    body = finding.weights.body(who) if finding.weights is not None else None
    if body is not None:
        return body
    return (
        f"The weights were already non-finite before this step ({origin.detail}): an "
        "earlier update corrupted them; roll back to a good checkpoint."
    )


def _external(finding: Finding, origin: Origin, who: str) -> str:
    """A tensor made before the step outside the model and the batch (external.py)."""
    site = finding.reader
    hop = finding.hop.chain()[1] if finding.hop is not None and finding.reader else None
    arg = f"its argument {hop.read_arg}" if hop is not None and hop.read_arg else "a tensor"
    maker = finding.nan_maker
    then = _nan_text(maker)
    if maker is not None and hop is not None and maker.site is hop.site:
        then = ", and made NaN of it"
    if site is None:
        return f"A constant made before the step is non-finite ({origin.detail}){then}; {who}."
    return (
        f"{site.op} in {where(site)} ({file_line(site.source)}) read a non-finite constant "
        f"made before the step: {arg}, the {origin.detail}{then}; {who}."
    )


def _op_root(finding: Finding, origin: Origin, site: OpSite, who: str) -> str:
    phase = finding.phase
    detail = f" ({origin.detail})" if origin.detail else ""
    inputs = "finite inputs" if origin.inputs_finite else "inputs holding ±inf but no NaN"
    made = origin.value.replace("nan", "NaN")
    at = f"{site.op} in {where(site)} ({file_line(site.source)})"
    if origin.kind == "constant":
        return f"{at} brought a non-finite constant ({made}){detail}; {who}."
    then = _nan_text(finding.nan_maker)
    if origin.masked_row is not None:
        sample = finding.masked_sample
        of = f" (sample {sample})" if sample is not None else ""
        return (
            f"{at} reduced a row that a mask covered entirely{of} to {made}{detail}{then}; {who}."
        )
    if origin.masked_read is not None:
        value = origin.masked_read.value
        turned = f" and turned it into {made}" if origin.value != value else ""
        return (
            f"{at} read a position that a mask set to {value}{turned}{detail}{then}: the mask "
            f"is deliberate, this read of it is not; {who}."
        )
    if phase == "backward":
        forward = site.forward
        of = f"{forward.op} in {where(site)} ({file_line(forward.source)})" if forward else "?"
        return (
            f"The forward pass was finite; in the backward pass {site.op} ({site.grad_fn}, the "
            f"gradient of {of}) turned finite gradients into {made}{detail}{then}; {who}."
        )
    if finding.loss_finite:
        return f"{at} turned {inputs} into {made}{detail}{_unread(finding)}; {who}."
    return f"{at} turned {inputs} into {made}{detail}{then}; {who}."


def _unread(finding: Finding) -> str:
    """A forward value the loss never read that the backward turned into non-finite
    gradients: where the gradient went non-finite."""
    entry = finding.backward_entry
    text = " in the forward pass, where the loss does not read it (the loss is finite)"
    if entry is None or entry.site is None:
        return text + "; the backward pass made the gradients non-finite from it"
    site = entry.site
    forward = site.forward
    of = f"{forward.op} in {where(forward)}" if forward is not None else "?"
    made = "NaN" if entry.value == "nan" else entry.value
    return (
        f"{text}; in the backward pass {site.op} ({site.grad_fn}, the gradient of {of}) "
        f"turned it into {made} gradients"
    )


def _nan_text(maker: Origin | None) -> str:
    if maker is None or maker.site is None:
        return ""
    site = maker.site
    at = f"{where(site)}, {file_line(site.source)}"
    if site.phase == "backward" and site.grad_fn:
        at = f"{site.grad_fn}, {at}"
    return f", and {site.op} ({at}) then turned that into NaN"
