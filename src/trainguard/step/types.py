"""The shared types of the step path, in one place: what a rank measured (``LocalReport``),
a started agreement (``Reduced``), the step as every rank sees it (``Agreement``: the record
the rules decide from, agreed values only), the decision (``Decision``) and how the loop
handed the step over (``StepCall``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from trainguard.step.folded_row import FoldedRow

SamplerDraws = Callable[[], list[list[int] | None]]
"""Gives, per micro-batch of a step, the dataset indices its ``DataLoader``'s sampler drew
(None for a micro-batch it cannot say): ``BatchStream.step_draws``, read only on a bad step."""

IndicesOf = Callable[[], list[int] | None]
"""Gives one forward's dataset indices when a bad step asks (None: not known)."""

ForwardDraws = Callable[[tuple[Any, ...], dict[str, Any]], IndicesOf | None]
"""At a training forward called with ``(args, kwargs)``: what gives its dataset indices
(``trainguard run``'s ``attach/loader_draws.py``), None when no followed loader yielded it."""


class Decision(enum.Enum):
    """What the guard does with a checked step."""

    OK = "ok"
    """Finite everywhere: the optimizer may step."""
    SKIP = "skip"
    """Non-finite: gradients cleared, ``check()`` returns False."""
    WARN = "warn"
    """Non-finite: logged, gradients left alone, ``check()`` returns False."""
    RAISE = "raise"
    """Non-finite and the policy is "raise": NonFiniteError on every rank."""
    ESCALATE = "escalate"
    """Too many bad steps in a row (or a collapsed loss scale): stop every rank."""
    OVERFLOW = "overflow"
    """fp16 gradient overflow that the GradScaler handles: skip, scale goes down."""
    SPIKE = "spike"
    """Finite, but a loss or gradient-norm spike and ``on_spike="skip"``: skipped like "skip"."""
    DROPPED = "dropped"
    """Finite, but the loop left the update out itself on some rank (``trainguard run``: its
    own ``if``): every rank leaves it out, so the replicas stay identical. Not a bad step."""


DROPPED_BY_LOOP = 1.0
"""``LocalReport.dropped``: the loop left the update out on this rank (``trainguard run`` saw
``zero_grad`` after a backward with no ``optimizer.step()``: ``attach/drops.py``)."""
DROPPED_WITH_SCALER = 2.0
"""``LocalReport.dropped``: as ``DROPPED_BY_LOOP``, in a process whose GradScaler scales the
loss (``scaler.step`` leaves the optimizer out after an fp16 overflow)."""


@dataclass(frozen=True, slots=True)
class StepCall:
    """How the loop handed a step to the pipeline: arguments of that one call, never state
    the guard keeps between calls (``Guard.check`` and its variants)."""

    loss_known: bool = True
    """False: the loss was not seen (``check_gradients``): the row's ``loss_unknown`` column
    says so, and when any rank's does, no rank's record holds a loss, the bundle says so and
    the spike rule reads none (``Agreement.loss_known``)."""
    dropped: float = 0.0
    """The row's ``dropped`` column (``LocalReport.dropped``): 0.0 unless this rank's loop
    left the step's update out itself (``trainguard run``)."""
    backward_ran: bool = True
    """False: the step ran no backward by design (a Lightning ``training_step`` that returned
    None): finding no gradient is not a forgotten ``backward()``."""
    leaving: bool = False
    """The row's ``leaving`` column (``LocalReport.leaving``): this rank's caller stops
    guarding after this step (``trainguard run`` found a loop it cannot guard on this rank
    only); every rank learns it from the agreement (``Agreement.leaving_ranks``) and stops
    at the same step."""


USUAL_CALL = StepCall()
"""``check(loss)``: the loss seen, the update going on, a backward ran."""


@dataclass(frozen=True)
class LocalReport:
    """What one rank saw during a step. ``values`` may be on the device (no sync needed)."""

    values: Tensor
    """float64 ``[loss, loss_check, grad_norm, input, fingerprint]``: the loss reported (the
    mean of the step's micro-batch losses), the sum of every micro-batch's loss (non-finite
    when any is), the L2 norm of this rank's gradients (non-finite when any gradient is), the
    largest ``|x|`` of the step's input tensors (non-finite when any input value is; 0
    unchecked),
    and a fingerprint of the replicated weights (0: not checked this step)."""
    exhausted: bool = False
    """This rank's data iterator is used up (``batches`` is then its exact total)."""
    batches: int = 0
    """Batches this rank has fetched so far."""
    data_time: float = 0.0
    """Seconds this rank waited for its data during the step (inside ``watch()``)."""
    compute_time: float = 0.0
    """Seconds of this rank's own compute during the step (its forward passes: no time
    spent waiting for other ranks; ``health.timing``)."""
    layout: FoldedRow | None = None
    """A world of one's folded row (``folded_row``): ``values`` holds the columns' pieces,
    reduced on the host at the read."""
    dropped: float = 0.0
    """0: this rank's loop goes on to the update; ``DROPPED_BY_LOOP`` or
    ``DROPPED_WITH_SCALER``: it already left the update out."""
    lr: float = 0.0
    """The learning rate this rank's optimizer step is about to use (the largest of its
    groups'; 0.0: not a host number; NaN: some scalar hyper-parameter of some group is not
    finite, ``hyperparams.row_lr``). It reaches the decision agreed (``Agreement.lr``,
    ``Agreement.hyper_ranks``), never read from the optimizer by a rule."""
    loss_scale: Tensor | None = None
    """This rank's GradScaler scale (a 0-d device tensor, copied into the row on the device:
    no host sync), None without an enabled scaler."""
    leaving: bool = False
    """This rank's caller stops guarding after this step (``StepCall.leaving``)."""
    loss_known: bool = True
    """False: this rank did not see its step's loss (``StepCall.loss_known``); its loss
    columns hold 0.0 (the row's ``loss_unknown`` column says so)."""


@dataclass(frozen=True)
class Reduced:
    """A started agreement: the buffer on the device, not read yet."""

    buf: Tensor
    report: LocalReport
    """This rank's report (its host fields fill the row in a world of one)."""
    sharded: bool
    """The gradients are shards (FSDP2): the global norm combines every rank's."""


@dataclass(slots=True)
class Agreement:
    """The step as every rank sees it after the all-reduce (identical on every rank)."""

    loss_ranks: list[int]
    grad_ranks: list[int]
    exhausted_ranks: list[int]
    batches: list[int]
    losses: list[float]
    global_grad_norm: float
    """The norm of all gradients: of every rank's shard (FSDP2), else rank 0's (replicated
    gradients), non-finite when any rank's is (``replicated_norm``)."""
    input_ranks: list[int] = field(default_factory=list)
    """Ranks whose step input (a floating-point tensor of the batch) was not finite."""
    data_times: list[float] = field(default_factory=list)
    """Per rank: seconds waiting for data in the step."""
    compute_times: list[float] = field(default_factory=list)
    """Per rank: seconds of its own compute in the step."""
    fingerprints: list[float] = field(default_factory=list)
    """Per rank: the replicated weights' fingerprint (all 0 when not checked this step)."""
    drops: list[float] = field(default_factory=list)
    """Per rank: ``LocalReport.dropped`` (empty: no rank dropped the update itself)."""
    lrs: list[float] = field(default_factory=list)
    """Per rank: the learning rate its optimizer step is about to use (0.0: unknown; NaN: a
    hyper-parameter of that rank's optimizer is not finite)."""
    loss_scales: list[float] = field(default_factory=list)
    """Per rank: its GradScaler's scale (0.0: no scaler)."""
    leaving_ranks: list[int] = field(default_factory=list)
    """Ranks whose caller stops guarding after this step (``StepCall.leaving``): every rank
    stops with them, at this step."""
    unknown_loss_ranks: list[int] = field(default_factory=list)
    """Ranks that did not see their step's loss (``StepCall.loss_known`` False: ``trainguard
    run`` where it found no loss, ``check_gradients``): then no rank's record holds a loss
    and the spike rule does not read one (``loss_known``)."""
    mean_loss: float = field(init=False)
    """The mean of the ranks' losses (computed once: every stage reads it)."""
    grad_norm: float = field(init=False)
    """The global gradient norm as reported: ``global_grad_norm``, Inf when it is not finite
    (``numerics.norm_or_inf``; computed once: every stage reads it)."""

    def __post_init__(self) -> None:
        losses = self.losses
        self.mean_loss = sum(losses) / len(losses)
        norm = self.global_grad_norm
        self.grad_norm = norm if math.isfinite(norm) else math.inf  # norm_or_inf, inline

    @property
    def loss_known(self) -> bool:
        """Every rank saw its step's loss: the losses are real numbers, not the 0.0 of a rank
        that saw none (the same answer on every rank, from the agreed row)."""
        return not self.unknown_loss_ranks

    @property
    def hyper_ranks(self) -> list[int]:
        """Ranks with a non-finite scalar hyper-parameter (an LR, a weight decay...): the
        update would write it into the weights."""
        lrs = self.lrs
        if math.isfinite(sum(lrs)):  # the usual case (and no rank's LR overflows a sum)
            return []
        return [rank for rank, lr in enumerate(lrs) if not math.isfinite(lr)]

    @property
    def lr(self) -> float | None:
        """The learning rate every rank's rules read: the smallest rank's, so a jump counts
        only when every rank's LR jumped (a schedule's warm restart, not a one-rank fault);
        None when some rank's is unknown."""
        lrs = self.lrs
        if len(lrs) == 1:  # a world of one: no generator
            only = lrs[0]
            return only if 0.0 < only < math.inf else None
        if not lrs or not all(0.0 < lr < math.inf for lr in lrs):
            return None  # NaN fails the comparison too
        return min(lrs)

    @property
    def lrs_differ(self) -> bool:
        """The ranks' learning rates differ (beyond float rounding): replicas that should
        step alike are about to step apart."""
        finite = [lr for lr in self.lrs if math.isfinite(lr)]  # a NaN is a finding of its own
        known = [lr for lr in finite if lr > 0.0]
        if not known:
            return False
        low, high = min(known), max(known)
        return len(known) != len(finite) or high - low > 1e-6 * high

    @property
    def loss_scale(self) -> float | None:
        """The smallest GradScaler scale over the ranks (a collapse on any rank counts), None
        without a scaler."""
        scales = [s for s in self.loss_scales if s > 0.0]
        return min(scales) if scales else None

    @property
    def dropped_ranks(self) -> list[int]:
        """Ranks whose loop left the step's update out itself (``trainguard run``)."""
        return [rank for rank, dropped in enumerate(self.drops) if dropped > 0.5]

    @property
    def scaler_dropped(self) -> bool:
        """Every rank left the update out in a process whose GradScaler scales the loss: the
        scaler's skip of an fp16 overflow, when the gradients are not finite."""
        return bool(self.drops) and all(d > DROPPED_WITH_SCALER - 0.5 for d in self.drops)

    @property
    def bad(self) -> bool:
        if self.loss_ranks or self.grad_ranks or self.input_ranks:
            return True
        # ``hyper_ranks``, its usual case without the call (a sum that overflows is not one)
        return not math.isfinite(sum(self.lrs)) and bool(self.hyper_ranks)

    @property
    def ranks(self) -> list[int]:
        """Ranks where the step went non-finite: the loss ranks when any, else the grad
        ranks, else the ranks with a non-finite input, else those with a non-finite
        hyper-parameter."""
        return self.loss_ranks or self.grad_ranks or self.input_ranks or self.hyper_ranks

    @property
    def where(self) -> str:
        if self.loss_ranks:
            return "loss"
        if self.grad_ranks:
            return "grad"
        return "input" if self.input_ranks else "hyperparameter"

    def steps_available(self, accumulation_steps: int) -> float:
        """How many optimizer steps the data allows: set by the ranks whose data ran out."""
        totals = [self.batches[r] // accumulation_steps for r in self.exhausted_ranks]
        return min(totals) if totals else math.inf
