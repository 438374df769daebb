"""From a traced re-run to a diagnosis: the phase, the op, the module, and one plain sentence."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from trainguard.capture import batchtree
from trainguard.capture.forward_inputs import describe as describe_forward
from trainguard.replay.localize import Hop, NonFiniteTracer, Origin
from trainguard.replay.seeds import seed_inputs, seed_outside, seed_parameters
from trainguard.replay.sites import ModuleStack, OpSite
from trainguard.replay.stepper import RunResult, StepRunner
from trainguard.replay.weights import WeightsEvidence

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
    weights: WeightsEvidence | None = None
    """Non-finite weights before the step: what the rows, the history and the optimizer
    state say of them (weights.py; set by the engine)."""

    @property
    def reader(self) -> OpSite | None:
        """A value from before the step read by some samples only (rows of a table) or made
        outside the model (a loss module's weight): the op that read it on the path."""
        origin = self.origin
        if origin is None or origin.site is not None:
            return None
        if origin.kind == "external" or (self.weights and self.weights.sample_specific):
            chain = self.hop.chain() if self.hop is not None else []
            return chain[1].site if len(chain) > 1 else None
        return None

    @property
    def site(self) -> OpSite | None:
        """Where the root ran (the reading op for a value from before the step)."""
        return self.origin.site if self.origin and self.origin.site else self.reader

    @property
    def op(self) -> str | None:
        return self.site.op if self.site else None

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
        if self.origin is not None and self.origin.kind == "parameter" and self.origin.label:
            return self.origin.label.rpartition(".")[0] or None
        site = self.site
        return site.module if site is not None else None

    @property
    def source(self) -> str | None:
        return self.site.source if self.site else None

    @property
    def loss_finite(self) -> bool:
        """The step's loss was finite (its gradients were not)."""
        return self.result.loss_finite

    def per_sample(self, hop: Hop | None) -> list[int] | None:
        """The samples holding ``hop``'s non-finite values: its non-finite leading indices
        when its leading size is the batch size."""
        size = self.batch_size
        if hop is None or hop.lead is None or not size or not hop.shape or hop.shape[0] != size:
            return None
        return hop.lead

    @property
    def reader_samples(self) -> list[int] | None:
        """Values from before the step: the samples they first reached on the path."""
        chain = self.hop.chain() if self.hop is not None else []
        if not chain or chain[0].site is not None:
            return None
        return next((s for h in chain[1:] if (s := self.per_sample(h)) is not None), None)

    @property
    def named_samples(self) -> list[int] | None:
        """The samples the finding itself names (where the root's values sit, a fully
        masked row's sample, the samples a value from before the step reached), when they
        are not the whole batch."""
        if self.masked_sample is not None:
            return [self.masked_sample]
        found = self.reader_samples
        if found is None and self.hop is not None:
            found = self.per_sample(self.hop.chain()[0])
        if not found or (self.batch_size and len(set(found)) >= self.batch_size):
            return None
        return found

    @property
    def backward_entry(self) -> Hop | None:
        """A forward root whose value reached only the gradients: the first backward op on
        the path (where the gradient went non-finite)."""
        if self.phase == "backward" or self.hop is None or not self.loss_finite:
            return None
        return next(
            (h for h in self.hop.chain() if h.site is not None and h.site.phase == "backward"),
            None,
        )

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
    modules.on_outside = lambda module: seed_outside(tracer, module)
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
        return Finding(_phase_of(origin, hop), origin, result, inputs, params, hop)
    if not result.grads_finite:
        hop = _bad_grad_hop(tracer, parameters)
        origin = tracer.first("backward")
        if origin is None and hop is not None:  # a forward value the loss never read
            return Finding(_phase_of(hop.origin, hop), hop.origin, result, inputs, params, hop)
        if hop is None or (origin is not None and hop.origin is not origin):
            hop = _latest(tracer, origin)
        return Finding("backward", origin, result, inputs, params, hop)
    return Finding(None, None, result, inputs, params)


def _phase_of(origin: Origin, hop: Hop | None) -> str:
    """The phase a root ran in: the batch, the model's forward, or the loss (a value made
    before the step outside the model: where its first reader ran)."""
    if origin.kind == "input":
        return "inputs"
    site = origin.site
    if site is None and origin.kind == "external" and hop is not None:
        chain = hop.chain()
        site = chain[1].site if len(chain) > 1 else None
    if site is None:
        return "forward"
    if site.phase == "backward":
        return "backward"
    return "forward" if site.in_model else "loss"


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
