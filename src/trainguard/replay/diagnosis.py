"""From a traced re-run to a diagnosis: the phase, the op, the module, and one plain sentence."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from trainguard.capture import batchtree
from trainguard.capture.forward_inputs import describe as describe_forward
from trainguard.replay.localize import Hop, NonFiniteTracer, Origin
from trainguard.replay.seeds import seed_inputs, seed_parameters
from trainguard.replay.sites import ModuleStack, OpSite
from trainguard.replay.stepper import RunResult, StepRunner

PHASES = ("inputs", "forward", "loss", "backward")


@dataclass
class Finding:
    """Where a reproduced step went non-finite."""

    phase: str | None
    origin: Origin | None
    """The root: the op that made the first non-finite value from finite inputs."""
    result: RunResult
    input_origins: list[Origin] = field(default_factory=list)
    parameter_origins: list[Origin] = field(default_factory=list)
    hop: Hop | None = None
    """The non-finite value that made the step bad (its chain leads back to the root)."""
    batch_size: int | None = None
    """The traced micro-batch's size (None: unknown, e.g. a live trace)."""

    @property
    def op(self) -> str | None:
        return self.origin.site.op if self.origin and self.origin.site else None

    @property
    def nan_maker(self) -> Origin | None:
        """The op that turned the root's ±inf into NaN (None: the root made NaN itself)."""
        return self.hop.nan_maker if self.hop is not None else None

    @property
    def nan_op(self) -> str | None:
        maker = self.nan_maker
        return maker.site.op if maker and maker.site else None

    @property
    def module(self) -> str | None:
        site = self.origin.site if self.origin else None
        if site is not None:
            return site.module
        if self.origin is not None and self.origin.kind == "parameter" and self.origin.label:
            return self.origin.label.rpartition(".")[0] or None
        return None

    @property
    def source(self) -> str | None:
        return self.origin.site.source if self.origin and self.origin.site else None

    @property
    def masked_sample(self) -> int | None:
        """The sample of a fully masked row: its leading index, when the reduction's input
        is batch-first (its leading size is the batch size) or the batch size is unknown."""
        row = self.origin.masked_row if self.origin is not None else None
        if row is None or row.sample is None:
            return None
        if self.batch_size is not None and row.shape[0] != self.batch_size:
            return None
        return row.sample


def locate(runner: StepRunner, micro: int) -> Finding:
    """Re-run micro-batch ``micro`` under the tracer and name the origin of the bad values."""
    modules = ModuleStack(runner.model)
    tracer = NonFiniteTracer(modules)
    batch = runner.micro_batches[micro]
    inputs = seed_inputs(tracer, batch, batchtree.leaves, batchtree.batch_size(batch))
    runner.restore_buffers()  # the runs before this one wrote them: seed the step's own
    params = seed_parameters(tracer, runner.model)
    with modules, tracer:
        result = runner.run(micro=micro, tracer=tracer, keep_loss=True)
    finding = finding_of(result, tracer, inputs, params, [p for _, p in runner.params])
    finding.batch_size = batchtree.batch_size(batch)
    return finding


def finding_of(
    result: RunResult,
    tracer: NonFiniteTracer,
    inputs: list[Origin],
    params: list[Origin],
    parameters: Sequence[Tensor],
) -> Finding:
    """The phase, root and path of a traced run (the bundle replay's and the live trace's)."""
    if not result.loss_finite:
        loss = result.loss_tensor
        hop = tracer.hop_of(loss) if isinstance(loss, Tensor) else None
        origin = hop.origin if hop else None
        origin = origin or tracer.first("forward") or next(iter(inputs + params), None)
        hop = hop or _latest(tracer, origin)
        if origin is None:
            return Finding("inputs" if inputs else "forward", None, result, inputs, params)
        if origin.kind == "input":
            phase = "inputs"
        elif origin.kind == "parameter" or origin.site is None:
            phase = "forward"
        else:
            phase = "forward" if origin.site.in_model else "loss"
        return Finding(phase, origin, result, inputs, params, hop)
    if not result.grads_finite:
        hop = _bad_grad_hop(tracer, parameters)
        origin = tracer.first("backward")
        if hop is None or (origin is not None and hop.origin is not origin):
            hop = _latest(tracer, origin)
        return Finding("backward", origin, result, inputs, params, hop)
    return Finding(None, None, result, inputs, params)


def _latest(tracer: NonFiniteTracer, origin: Origin | None) -> Hop | None:
    if origin is None:
        return None
    return tracer.latest.get(id(origin)) or tracer.root_hops.get(id(origin))


def _bad_grad_hop(tracer: NonFiniteTracer, parameters: Sequence[Tensor]) -> Hop | None:
    for param in parameters:
        grad = param.grad
        if grad is not None:
            hop = tracer.hop_of(grad)
            if hop is not None:
                return hop
    return None


# -- the sentence --------------------------------------------------------------------------


def _file_line(source: str | None) -> str:
    if not source:
        return "unknown line"
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}"


def _where(site: OpSite) -> str:
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
) -> str:
    """Who is to blame; ``complete`` None: no bisection ran."""
    if not culprits:
        if every:
            return "every sample tried makes the step non-finite on its own"
        if batch_level:
            return "no single sample is to blame: the cause is the batch as a whole"
        if complete is None:
            return "the samples to blame were not searched for (no bisection)"
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
) -> str:
    origin, phase = finding.origin, finding.phase
    who = culprit_text(culprits, batch_level, complete, every)
    if origin is None:
        what = {
            "inputs": "the batch holds non-finite values",
            "backward": "the forward pass was finite but the gradients were not",
        }.get(phase or "", f"the step went non-finite in the {phase} phase")
        return f"The step reproduced ({what}), but no single op could be named; {who}."
    if origin.kind == "input":
        return f"The batch itself is bad: {origin.detail}; {who}. Fix or filter the data."
    if origin.kind == "parameter":
        return (
            f"The weights were already non-finite before this step ({origin.detail}): an "
            "earlier update corrupted them; roll back to a good checkpoint."
        )
    site = origin.site
    if site is None:
        return f"The step reproduced ({origin.detail}); {who}."
    detail = f" ({origin.detail})" if origin.detail else ""
    inputs = "finite inputs" if origin.inputs_finite else "inputs holding ±inf but no NaN"
    made = origin.value.replace("nan", "NaN")
    if origin.kind == "constant":
        action = f"brought a non-finite constant ({made})"
        return f"{site.op} in {_where(site)} ({_file_line(site.source)}) {action}{detail}; {who}."
    then = _nan_text(finding.nan_maker)
    if origin.masked_row is not None:
        sample = finding.masked_sample
        of = f" (sample {sample})" if sample is not None else ""
        return (
            f"{site.op} in {_where(site)} ({_file_line(site.source)}) reduced a row that a "
            f"mask covered entirely{of} to {made}{detail}{then}; {who}."
        )
    if phase == "backward":
        forward = site.forward
        of = f"{forward.op} in {_where(site)} ({_file_line(forward.source)})" if forward else "?"
        return (
            f"The forward pass was finite; in the backward pass {site.op} ({site.grad_fn}, the "
            f"gradient of {of}) turned finite gradients into {made}{detail}{then}; {who}."
        )
    return (
        f"{site.op} in {_where(site)} ({_file_line(site.source)}) turned {inputs} into "
        f"{made}{detail}{then}; {who}."
    )


def _nan_text(maker: Origin | None) -> str:
    if maker is None or maker.site is None:
        return ""
    site = maker.site
    where = f"{_where(site)}, {_file_line(site.source)}"
    if site.phase == "backward" and site.grad_fn:
        where = f"{site.grad_fn}, {where}"
    return f", and {site.op} ({where}) then turned that into NaN"


def made_in_loop_summary(runs: list[RunResult], device: str, meta: dict[str, Any]) -> str:
    """The summary of a step that replays finite from its fetched batch while the model's
    forward had got a non-finite input (``capture/forward_inputs.py``)."""
    found = meta["forward_inputs"]
    loss = step_loss(runs)
    return (
        f"The step did not reproduce from the batch as fetched ({len(runs)} replays on "
        f"{device}, finite loss {loss:.6g}), but on rank {meta.get('rank')} the model's "
        f"forward got non-finite input at {describe_forward(found)} that the fetched batch "
        "did not hold: the loop made it between the fetch and the forward, code the replay "
        "does not run. No transient fault is needed to explain this step."
    )


def step_loss(runs: list[RunResult]) -> float:
    """The first replay's loss of the step as the guard reports it: the mean of its
    micro-batch losses (NaN without a run)."""
    losses = runs[0].losses if runs else []
    return sum(losses) / len(losses) if losses else math.nan


def recorded_loss_runs(runs: list[RunResult], meta: dict[str, Any]) -> int:
    """How many of ``runs`` gave the rank's recorded loss again (a spike's bundle)."""
    recorded = meta.get("loss")
    if not isinstance(recorded, (int, float)):
        return 0
    return sum(math.isclose(recorded, step_loss([r]), rel_tol=1e-5) for r in runs)


def spike_summary(
    runs: list[RunResult], deterministic: bool, device: str, meta: dict[str, Any]
) -> tuple[str, str]:
    """The verdict and sentence of a spike's bundle (finite when it ran, finite replayed):
    ``spike`` when the replays give the recorded loss again, else ``not_reproduced``."""
    recorded = meta.get("loss")
    n = len(runs)
    loss = step_loss(runs)
    norm = runs[0].grad_norm if runs else math.nan
    if (
        deterministic
        and isinstance(recorded, (int, float))
        and math.isclose(recorded, loss, rel_tol=1e-5)
    ):
        return "spike", (
            f"The spike reproduces: {n} replays on {device} gave the recorded loss "
            f"({loss:.6g}; gradient norm {norm:.6g}{_norm_note(norm, meta, runs)}), bit for "
            "bit the same each time: the step's own batch and weights make it, not a "
            "transient fault."
        )
    what = f"{recorded:.6g}" if isinstance(recorded, (int, float)) else "no loss"
    same = "bit for bit the same" if deterministic else "differing bit for bit"
    return "not_reproduced", (
        f"The spike did not reproduce: {n} replays on {device} gave loss {loss:.6g} "
        f"({same}) where rank {meta.get('rank')} recorded {what}: the loop did something "
        "the replay does not (a transform between the fetch and the forward, a loss_fn "
        "other than the loop's), or the step's kernels are nondeterministic."
    )


def _norm_note(norm: float, meta: dict[str, Any], runs: list[RunResult]) -> str:
    """Beside a replayed gradient norm: the recorded one when they differ; and why: by the
    step's micro-batch count (the replay backpropagates each micro-batch's loss as the
    loss_fn returns it, where the loop divided it by the count), or, of several ranks, the
    recorded one is of the gradients all-reduced over them (the replay runs one rank)."""
    recorded = meta.get("local_grad_norm")
    if not isinstance(recorded, (int, float)) or not math.isfinite(recorded) or recorded <= 0:
        return ""
    if math.isclose(norm, recorded, rel_tol=1e-4):
        return ""
    note = f"; rank {meta.get('rank')} recorded {recorded:.6g}"
    micro = len(runs[0].losses) if runs else 0
    world = meta.get("world_size")
    if micro > 1 and math.isclose(norm / recorded, micro, rel_tol=1e-3):
        note += (
            f": {micro} micro-batches, each loss backpropagated as the loss_fn returns it, "
            f"where the loop divided it by {micro}"
        )
    elif isinstance(world, int) and world > 1:
        note += (
            f" after the gradient all-reduce over the {world} ranks (DDP averages them); the "
            "replay's is this rank's own gradients"
        )
    return note


def entry_text(entry: dict[str, Any]) -> str:
    """One of ``batchtree.nonfinite_tensors``' entries as text: path, micro-batch, samples."""
    samples = entry.get("dataset_indices") or entry.get("positions") or []
    which = "dataset indices" if entry.get("dataset_indices") else "samples"
    shown = f", {which} {samples}" if samples else ""
    return f"{entry['path']} (micro-batch {entry['micro_batch']}{shown})"


def unread_culprits(unread: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples holding the non-finite values the loss does not read, as culprits."""
    culprits: list[dict[str, Any]] = []
    for entry in unread:
        indices = entry.get("dataset_indices") or []
        for n, position in enumerate(entry.get("positions") or []):
            found = {
                "micro_batch": entry["micro_batch"],
                "position": position,
                "index": indices[n] if n < len(indices) else None,
            }
            if found not in culprits:
                culprits.append(found)
    return culprits


def recorded_nonfinite(meta: dict[str, Any]) -> str | None:
    """What the rank recorded non-finite (``"loss nan and non-finite gradients"``), or None
    when its recorded loss and gradients were finite (or not seen)."""
    parts = []
    if meta.get("loss_finite") is False:
        parts.append(f"loss {meta.get('loss')}")
    if meta.get("grad_finite") is False:
        parts.append("non-finite gradients")
    return " and ".join(parts) or None


def unread_input_verdict(
    runs: list[RunResult], unread: list[dict[str, Any]], device: str, meta: dict[str, Any]
) -> tuple[str, str]:
    """The batch holds non-finite values and the replayed step is finite: ``input_mask``
    when they are additive masks (only 0 and -inf) and the recorded step was finite,
    ``bad_input`` when the recorded loss and gradients were finite too (the loss does not
    read them: the guard's input check, which reads every floating-point tensor of the
    batch, skipped the step), ``input_handled`` when the recorded step was non-finite (the
    factory's loss_fn handles them now: a fix that works, or another loss_fn than the
    loop's)."""
    where = "; ".join(entry_text(e) for e in unread[:5])
    more = f" and {len(unread) - 5} more" if len(unread) > 5 else ""
    replayed = (
        f"{len(runs)} replays on {device} gave a finite loss ({step_loss(runs):.6g}) and "
        "finite gradients"
    )
    recorded = recorded_nonfinite(meta)
    if recorded is None and all(e.get("additive_mask") for e in unread):
        return "input_mask", (
            f"The batch's non-finite values are an additive mask: {where}{more} holds only 0 "
            f"and -inf. The step is finite: {replayed}, as the recorded ones were. The guard's "
            "input check, which stops a step for any NaN/Inf in the batch, skipped it for "
            "that mask."
        )
    if recorded is None:
        return "bad_input", (
            f"The batch holds non-finite values: {where}{more}. The loss does not read them: "
            f"{replayed}. The input check skipped the step for them; fix the data, or leave "
            "the field out of the batch if the model never uses it."
        )
    return "input_handled", (
        f"The recorded step was non-finite (rank {meta.get('rank')} recorded {recorded}) "
        f"on a batch holding non-finite values: {where}{more}. This replay is not: "
        f"{replayed} from the same batch and weights, so the factory's loss_fn handles those "
        "values: a fix that works on this step, or a loss_fn other than the loop's."
    )


def not_reproduced_summary(
    runs: list[RunResult], deterministic: bool, device: str, meta: dict[str, Any]
) -> str:
    recorded = meta.get("loss")
    where = "loss" if meta.get("loss_finite") is False else "gradients"  # None: not seen
    host = (meta.get("env") or {}).get("host", "the same host")
    n = len(runs)
    loss = step_loss(runs)
    if not deterministic:
        return (
            f"The step did not reproduce: {n} replays on {device} were finite but differ bit "
            f"for bit (nondeterministic kernels), while rank {meta.get('rank')} recorded "
            f"non-finite {where}; rerun with more --repeats, under "
            "torch.use_deterministic_algorithms(True), or on the device it failed on."
        )
    same = ""
    if isinstance(recorded, (int, float)) and math.isclose(recorded, loss, rel_tol=1e-5):
        same = ", the same loss as recorded"
    return (
        f"The step did not reproduce: {n} replays on {device} gave a finite loss ({loss:.6g}"
        f"{same}) and finite gradients, bit for bit the same, while rank {meta.get('rank')} "
        f"recorded non-finite {where}; the fault came from outside this forward and backward "
        "(a transient hardware or communication fault, or a gradient changed after backward): "
        f"rerun it on another device (--device) or another host than {host}."
    )
