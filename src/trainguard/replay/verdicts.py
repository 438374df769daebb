"""What kind of problem a step had (its ``verdict``) and what to do about it (``advice``).

The classes, checked in this order:

- ``replica_mismatch``: the bundle's ranks hold different values of a replicated parameter
  (replicas.py; decided by the bundle replay, before any class below, whether the step
  reproduces or not).
- ``bad_input``: the batch itself holds non-finite values.
- ``input_mask``: the replay was finite, as the recorded step was, on a batch whose
  non-finite values are additive masks (only 0 and -inf): the guard's input check stopped a
  deliberate mask. (A mask in the batch that *does* make the step non-finite, a row masked
  entirely, is ``masked_row``.)
- ``input_handled``: the replay was finite on a batch holding non-finite values, and the
  recorded step was non-finite: the factory's ``loss_fn`` handles those values (a fix
  under test that works, or another ``loss_fn`` than the loop's).
- ``nonfinite_hyperparameter``: a param group's scalar hyper-parameter (lr, weight_decay, eps,
  a beta...) was not finite: the update before the step wrote the group's weights non-finite
  through it (the history and the optimizer state say which step, which group, which
  hyper-parameter: writer.py), or the step's own optimizer state holds it (the guard stopped
  the step before its optimizer step; its forward and backward replay finite).
- ``nonfinite_rows``: weights non-finite before the step that only some samples read (rows
  of an embedding, per-class rows, per-expert weights): the rows, the op and the samples
  that read them, and whether an update ever touched them (weights.py, rows.py).
- ``nonfinite_initial_weights``: weights non-finite before the run's first update (the
  history runs from step 0 and none was applied before the step): the initialization or a
  loaded checkpoint made them (weights.py).
- ``nonfinite_weights``: any other weights or buffers non-finite before the step.
- ``nonfinite_constant``: an op read a non-finite tensor made before the step outside the
  model and the batch: a loss module's buffer (class weights with an inf), a tensor the loop
  made (external.py).
- ``masked_row``: the root is a reduction (softmax, logsumexp, max, sum...) over a row that a
  mask covered entirely (masks.py).
- ``masked_position``: the root read a position that a mask set to -inf in a row the mask
  covers only partly, and made a real inf or NaN of it: the loss at a target the mask forbids
  (masked_reads.py).
- ``divergence``: the loss or the gradient norm grew over the recent steps (the bundle's
  history, two finite steps are enough) until it overflowed; or the updates ran away
  (``Runaway``): the learning rate jumped in the last few steps, or the weights before the
  step are larger than a healthy run's (``RUNAWAY_WEIGHT``); the sentence names the learning
  rate and the largest weight.
- ``overflow_fp16`` / ``overflow_bf16``: the step is non-finite under float16 / bfloat16
  autocast and finite in float32 (the replay runs it once more without autocast) at an op
  that is no domain op (a domain op there, ``log(1 - sigmoid(x))`` with ``sigmoid`` rounded
  to 1, is ``numerical``: the dtype's rounding, not its range), or the
  root op's output is half / bfloat16 and it overflowed the dtype's range (not a domain
  edge such as ``log(0)``).
- ``batch_statistics``: no single sample is to blame (bisection), and the root's value is
  no per-sample value: a statistic over a batch too small for it (an empty class, the
  variance of one sample).
- ``numerical``: an op at a domain edge (log, div, sqrt, acos, pow, std...).
- ``input_made_in_loop``: the replay was finite, and the model's forward had got a
  non-finite input that the fetched batch did not hold: the loop made it between the fetch
  and the forward, which the replay does not run (``capture/forward_inputs.py``).
- ``loss_not_replayed``: the replay was finite, but the run's loss came from a computation
  the replay's loss_fn does not do (``meta.json``'s ``loss_source``: the HF Trainer's own
  ``compute_loss``, replayed with ``replay_spec``'s model loss): nothing to conclude yet.
- ``not_reproduced``: the replay was finite: a transient fault.
- ``spike``: a finite step the spike rule skipped (a ``spike`` bundle), and the replay gives
  the recorded loss again: the step's own batch and weights make the spike.
"""

from __future__ import annotations

from trainguard.replay.diagnosis import Finding
from trainguard.replay.divergence import Growth, Runaway

VERDICTS = (
    "replica_mismatch",
    "bad_input",
    "input_mask",
    "input_handled",
    "nonfinite_hyperparameter",
    "nonfinite_rows",
    "nonfinite_initial_weights",
    "nonfinite_weights",
    "nonfinite_constant",
    "masked_row",
    "masked_position",
    "divergence",
    "overflow_fp16",
    "overflow_bf16",
    "batch_statistics",
    "numerical",
    "input_made_in_loop",
    "loss_not_replayed",
    "not_reproduced",
    "spike",
)

ADVICE = {
    "replica_mismatch": "Replicas that should be equal drifted apart: something wrote to one "
    "rank's weights alone (a rank-local write such as `if rank == 0: ...`, a hook, custom op or "
    "optimizer that edits one rank, a bit flip in that GPU's memory) or the weights were never "
    "broadcast at the start (no DDP wrap, a rank that loaded another checkpoint). Resync them "
    "(broadcast from a good rank or resume from a checkpoint), check that the replicas agree "
    "every N steps (compare a checksum of the weights across ranks), and if it keeps hitting "
    "one rank, test that GPU.",
    "bad_input": "Fix or filter the data: check the sample named above at its source, and "
    "validate batches before the forward pass.",
    "input_mask": "If the mask's -inf are deliberate, name the mask in the Guard's "
    "inputs.ignore (e.g. inputs=InputConfig(ignore=('attention_mask',)): the rest of the "
    "batch, the loss and the gradients stay checked at every step), or carry the mask as "
    "booleans and build the -inf in the model (masked_fill): then the input check reads no "
    "-inf. If they are not deliberate, find where they are written.",
    "input_handled": "The batch's non-finite values made the recorded step non-finite, and "
    "the factory's loss_fn handles them: if that loss_fn is your fix (nan_to_num, a mask, "
    "dropping the samples), it works on this step (the replay exits 0); still find where the "
    "values come from (the samples named above, at their source). If you did not change "
    "loss_fn, the factory's is not the loop's: replay with the loop's own loss_fn to "
    "diagnose the step.",
    "nonfinite_hyperparameter": "A param group's hyper-parameter was not finite (a learning-rate "
    "schedule that divides by zero: a warm-up or decay of length 0, a per-group scale computed "
    "from an empty statistic). Fix that group's schedule where it divides. Where the update "
    "ran (its weights are non-finite), resume from a checkpoint taken before the step named. "
    "The guard checks every group's scalar hyper-parameters before the optimizer step and, "
    "with on_nonfinite='skip', skips such a step on every rank before it writes the weights.",
    "nonfinite_rows": "Rows of a table hold non-finite values that only some inputs read (rows "
    "added to an embedding or position table and never initialised, a class or expert no "
    "input has reached yet): initialise them when the table is grown or loaded (copy or "
    "nn.init the new rows; torch.empty is not initialised), check the table once then "
    "(torch.isfinite(weight).all()), or keep the inputs inside the initialised range. The "
    "samples named only read those rows: they are not bad data.",
    "nonfinite_constant": "A tensor made before the step holds a non-finite value that an op "
    "reads (class weights estimated on a sample that lacked a class: count 0 -> 1/0 = inf; "
    "a normalisation constant of an empty set). Fix it where it is made (smooth the counts, "
    "clamp them, estimate on the whole data set), and check such constants once, when they "
    "are made (torch.isfinite(t).all()).",
    "masked_position": "An op read a position that a mask set to -inf: the loss at a target "
    "the mask forbids (a grammar or schema mask that disallows the labelled token), a sum or "
    "product over masked logits. Make the labels and the mask agree (fix the label, or allow "
    "the labelled token), give such targets the loss's ignore_index, or mask with a finite "
    "value (torch.finfo(dtype).min) so that one bad target costs a large finite loss instead "
    "of the step.",
    "nonfinite_initial_weights": "The weights were non-finite before the run's first update: "
    "the model's initialization or the checkpoint it loaded made them. A model built on the "
    "meta device (or with torch.empty) holds uninitialized memory after to_empty() until every "
    "parameter is initialized: call reset_parameters() or an nn.init on every submodule, not "
    "only on the top module's own layers; check the weights once after building or loading "
    "(all(torch.isfinite(p).all() for p in model.parameters())). If a checkpoint was loaded, "
    "check that file, or load an earlier one.",
    "nonfinite_weights": "The weights were corrupted before this step (a bad checkpoint or an "
    "earlier silent update): resume from the last good checkpoint and find the step that "
    "wrote them.",
    "masked_row": "A mask covered a whole row of a reduction (every key of a query padded, "
    "a sample with no valid token): softmax of an all -inf row is 0/0. Keep at least one "
    "unmasked element per row (let padding attend to itself), mask with a finite value "
    "(torch.finfo(dtype).min) instead of -inf, drop fully masked samples, or zero the "
    "fully masked rows' output after the softmax.",
    "divergence": "Training diverged: lower the learning rate, add or lengthen the warm-up, "
    "and clip the gradient norm.",
    "overflow_fp16": "A float16 value exceeded 65504: compute this op in float32 (autocast "
    "exclusion or .float()), scale the values down, or train in bfloat16.",
    "overflow_bf16": "A bfloat16 value exceeded its range (about 3.4e38): compute this op in "
    "float32 and look for the unbounded value that feeds it.",
    "batch_statistics": "A statistic over the batch is undefined for this batch (an empty "
    "class, a variance of one sample): guard the denominator (clamp the count, add eps) or "
    "use larger batches.",
    "numerical": "An op was evaluated at the edge of its domain: clamp its input (log(x + "
    "eps), x.clamp_min(eps) before sqrt/div/pow, acos of clamp(-1 + eps, 1 - eps)) or use "
    "the stable form (log_softmax, logsumexp, softplus).",
    "input_made_in_loop": "The loop turned a finite batch into a non-finite model input "
    "between the fetch and the forward (a normalization by a zero std, a log or division in a "
    "transform, a cast): fix that code, or move it into the dataset / collate_fn (then the "
    "guard's input check names the sample) or into the replay factory's loss_fn (then the "
    "replay runs it and locates the op).",
    "loss_not_replayed": "Write the factory's loss_fn with the run's own loss computation (it "
    "gets the model and the recorded micro-batch) and replay again: until the replay computes "
    "the loss the run computed, a finite replay points at no transient fault and at no "
    "device.",
    "not_reproduced": "The step is finite when re-run: a transient fault. If it keeps "
    "happening on the same rank or host, test that GPU or node (memory test, DCGM "
    "diagnostics) and take it out of the pool.",
    "spike": "The step's own batch and weights make the spike: inspect the batch (trainguard "
    "inspect: an outlier, a wrong label, an unusually long sequence) and the learning rate at "
    "this step; if spikes recur, lower the learning rate or its warm-up, clip the gradients "
    '(grad_clip=), or let the guard roll back past them (on_spike="rollback").',
}

SPIKE_NOT_REPRODUCED_ADVICE = (
    "The spike did not recur from the same weights and batch: something outside the replayed "
    "step made it. Look at what the loop does that the replay does not: the loss scaling (a "
    "loss passed to the guard scaled, by a GradScaler or by hand), the data of that step as "
    "the loop fetched and transformed it (a transform between the fetch and the forward), a "
    "loss_fn other than the loop's; or nondeterministic kernels (rerun with more --repeats, "
    "under torch.use_deterministic_algorithms(True), or on the device it ran on). A spike is "
    "a finite step: this is no transient fault to suspect a device for."
)
"""The advice of a spike's bundle (``"trigger": "spike"``) whose replays do not give the
recorded loss again (verdict ``not_reproduced``)."""

RECEIVED_ADVICE = (
    "This rank only received the non-finite gradients through the all-reduce: its own step "
    "is fine. Diagnose the rank where they arose (replay without --rank); this rank's device "
    "is not a suspect."
)
"""The advice of a ``--rank`` whose own replay is finite while another rank made the NaN."""

OVERWRITTEN_ADVICE = (
    "Replay a later bad step of this run (from the step after this one, its micro-batches are "
    "copies), or have the loop hand each micro-batch to the model as a tensor of its own."
)
"""A finite replay of a capture that lacks micro-batches the loop overwrote."""

ELSEWHERE_ADVICE = (
    "The step went non-finite on another rank, not on this one: diagnose that rank (replay "
    "without --rank); this rank's device is not a suspect."
)
"""The advice of a ``--rank`` that was finite while another rank went non-finite."""

DOMAIN_OPS = frozenset(
    f"aten.{name}"
    for name in [
        "log",
        "log2",
        "log10",
        "log1p",
        "div",
        "reciprocal",
        "rsqrt",
        "sqrt",
        "pow",
        "acos",
        "asin",
        "atanh",
        "acosh",
        "xlogy",
        "lgamma",
        "digamma",
        "polygamma",
        "erfinv",
        "std",
        "var",
        "std_mean",
        "var_mean",
        "linalg_vector_norm",
        "norm",
        "remainder",
        "fmod",
        "_softmax",
        "_log_softmax",
        "special_xlog1py",
    ]
)
HALF_DTYPES = {"float16": "overflow_fp16", "bfloat16": "overflow_bf16"}
WEIGHTS = (
    "nonfinite_hyperparameter",
    "nonfinite_rows",
    "nonfinite_initial_weights",
    "nonfinite_weights",
)
"""The verdicts of weights non-finite before the step (weights.py)."""


def classify(
    finding: Finding,
    batch_level: bool,
    grew: Growth | None,
    batch_size: int | None = None,
    only_half: str | None = None,
    ran_away: Runaway | None = None,
) -> str:
    """The verdict of a reproduced step. ``batch_level``: bisection found no sample to blame
    (``batch_size``: the bisected batch's size). ``only_half``: the autocast dtype the step
    is non-finite under while it is finite in float32."""
    if finding.phase == "inputs":
        return "bad_input"
    if finding.parameter_origins:
        return finding.weights.verdict if finding.weights is not None else "nonfinite_weights"
    if finding.origin is not None and finding.origin.kind == "external":
        return "nonfinite_constant"
    if finding.origin is not None and finding.origin.masked_row is not None:
        return "masked_row"
    if finding.origin is not None and finding.origin.masked_read is not None:
        return "masked_position"
    if grew is not None or ran_away is not None:
        return "divergence"
    if only_half in HALF_DTYPES:  # a domain op: the half dtype's rounding, no overflow
        return "numerical" if finding.op in DOMAIN_OPS else HALF_DTYPES[only_half]
    overflow = _overflow(finding)
    if overflow is not None:
        return overflow
    if batch_level and not _per_sample(finding, batch_size):
        return "batch_statistics"
    return "numerical"


def _per_sample(finding: Finding, batch_size: int | None) -> bool:
    """The root's non-finite value is in a per-sample tensor (its leading size is the batch
    size): every sample is bad on its own, which is no statistic over the batch."""
    root = finding.hop.chain()[0] if finding.hop is not None else None
    shape = root.shape if root is not None else []
    return bool(batch_size) and bool(shape) and shape[0] == batch_size


def _overflow(finding: Finding) -> str | None:
    hop, origin = finding.hop, finding.origin
    if origin is None or origin.kind != "op" or not origin.inputs_finite:
        return None
    if origin.value == "nan" or finding.op in DOMAIN_OPS:
        return None
    root = hop.chain()[0] if hop is not None else None
    dtype = root.dtype if root is not None and root.origin is origin else None
    return HALF_DTYPES.get(dtype or "")


def verdict_sentence(
    verdict: str,
    finding: Finding | None,
    grew: Growth | None,
    only_half: str | None = None,
    ran_away: Runaway | None = None,
) -> str:
    """A sentence that leads the summary for the classes whose cause is not the op itself."""
    if verdict in HALF_DTYPES.values() and only_half is not None and finding is not None:
        where = f" in {finding.module}" if finding.module else ""
        op = f"{finding.op}{where}" if finding.op else "an op"
        return (
            f"The step is non-finite under {only_half} autocast and finite in float32: {op} "
            f"overflowed the range of {only_half}."
        )
    if verdict == "numerical" and only_half is not None and finding is not None:
        where = f" in {finding.module}" if finding.module else ""
        return (
            f"The step is non-finite under {only_half} autocast and finite in float32: "
            f"{finding.op}{where} met the edge of its domain because {only_half} rounded its "
            "input there (e.g. 1 - sigmoid(x) is exactly 0 once sigmoid(x) rounds to 1), not "
            f"because a value overflowed: compute it in float32, or use a form that never "
            "forms the rounded value (logsigmoid, binary_cross_entropy_with_logits, "
            "log_softmax)."
        )
    if verdict == "divergence" and (grew is not None or ran_away is not None):
        said = [part.text() for part in (ran_away, grew) if part is not None]
        return f"The run diverged: {'; '.join(said)}."
    if verdict in WEIGHTS and finding is not None and finding.weights is not None:
        return finding.weights.lead()
    if verdict == "nonfinite_weights" and finding is not None:
        names = [o.label for o in finding.parameter_origins if o.label]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return f"Non-finite weights before the step: {shown}."
    if verdict in HALF_DTYPES.values() and finding is not None:
        dtype = "float16" if verdict == "overflow_fp16" else "bfloat16"
        return f"{finding.op} overflowed the range of {dtype}."
    return ""
