"""Non-finite input data: one fused pass over the floating-point tensors of a step's batches.

``watch()`` (or, in a loop without it, ``record_batch()``: the Lightning and HF callbacks,
``trainguard run``) hands the guard each step's micro-batches; at the check the guard takes the
largest absolute value over every floating-point tensor in them (on an accelerator one
fused ``torch._foreach_norm(inf)`` per device; on the CPU ``aminmax`` per tensor, which is
much faster there). That maximum is non-finite exactly when some
input value is NaN/Inf (no overflow: it is a max, not a sum of squares), and it rides the
step's all-reduce as one more device column, so a bad input marks the step bad on every
rank with no extra collective and no host sync. The batch is read on the host only on a
bad step, to name the tensor's path in the batch, the sample positions and (when the batch
carries an ``index`` / ``indices`` field) the dataset indices.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from trainguard.capture import batchpaths, batchtree
from trainguard.events import EventLog
from trainguard.numerics import stored_values
from trainguard.step.detect import fused_takes
from trainguard.step.types import Agreement, SamplerDraws

logger = logging.getLogger(__name__)


def mask_note(path: str) -> str:
    """Said of a non-finite input at ``path`` that looks like an additive attention / padding
    mask: how to leave it out of the check."""
    name = batchpaths.ignore_name(path)
    leave_out = (
        f"inputs=InputConfig(ignore=({name!r},)) (trainguard run: --ignore-inputs "
        f"{shlex.quote(name)})"
        if name
        else "inputs=InputConfig(check=False) (trainguard run: --no-check-inputs)"
    )
    return (
        f"; it holds only 0 and -inf: an additive mask? If deliberate, pass {leave_out} (the "
        "loss and the gradients stay checked) or build the -inf in the model from a boolean mask"
    )


def float_tensors(batches: Sequence[Any], ignore: frozenset[str] = frozenset()) -> list[Tensor]:
    """The non-empty floating-point tensors of the batches (detached; no copies); a sparse
    tensor by its stored values (``numerics.stored_values``: a COO tensor coalesced).
    ``ignore``: ``ignore_inputs``, the entries left out (``batchpaths.tensors_outside``)."""
    found: list[Tensor] = []
    for batch in batches:
        walked = batchpaths.tensors_outside(batch, ignore) if ignore else batchtree.tensors(batch)
        for tensor in walked:
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            if tensor.layout == torch.strided:  # the usual case: itself, no detach op
                found.append(tensor.detach() if tensor.requires_grad else tensor)
                continue
            values = stored_values(tensor.detach())
            if values.numel() > 0:
                found.append(values)
    return found


def max_abs(tensors: list[Tensor], device: torch.device) -> Tensor:
    """float64 scalar on ``device``: the largest ``|x|`` (0 without tensors); NaN/Inf when
    any value is. No host sync."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    where = tensors[0].device
    if _on_one(tensors, where):  # the usual case: one device
        top = _cpu_max_abs(tensors) if where.type == "cpu" else _fused_max_abs(tensors)
        return top if where == device else top.to(device, non_blocking=True)
    by_device: dict[torch.device, list[Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    maxima = []
    for where, group in by_device.items():
        top = _cpu_max_abs(group) if where.type == "cpu" else _fused_max_abs(group)
        maxima.append(top.to(device, non_blocking=True))
    return maxima[0] if len(maxima) == 1 else torch.stack(maxima).amax()


def _on_one(tensors: list[Tensor], where: torch.device) -> bool:
    return len(tensors) == 1 or all(tensor.device == where for tensor in tensors)


def _fused_max_abs(group: list[Tensor]) -> Tensor:
    """Accelerators: one fused ``_foreach_norm(inf)`` launch for every tensor."""
    norms = torch._foreach_norm(group, float("inf"), dtype=torch.float64)
    return torch.stack(list(norms)).amax()  # amax propagates NaN


def _cpu_max_abs(group: list[Tensor]) -> Tensor:
    """CPU: ``aminmax`` per tensor (NaN-propagating; measured about 10x faster there than
    ``_foreach_norm(inf)`` with float64 results, see benchmarks/input_check_cost.py), then
    per dtype one ``stack`` of the ends and one float64 ``inf``-norm of them (``max |end|``,
    NaN-propagating): two ops more than the tensors, not three per tensor (issue 26)."""
    dtype = group[0].dtype
    found: list[Tensor] = []
    for tensor in group:
        if tensor.dtype != dtype:
            break
        found.extend(torch.aminmax(tensor))
    else:  # the usual case: one dtype
        top: Tensor = torch.linalg.vector_norm(
            torch.stack(found), float("inf"), dtype=torch.float64
        )
        return top
    ends: dict[torch.dtype, list[Tensor]] = {}
    for tensor in group:
        ends.setdefault(tensor.dtype, []).extend(torch.aminmax(tensor))
    maxima = [
        torch.linalg.vector_norm(torch.stack(of_dtype), float("inf"), dtype=torch.float64)
        for of_dtype in ends.values()
    ]
    return maxima[0] if len(maxima) == 1 else torch.stack(maxima).amax()


class InputCheck:
    """The guard's input check: a device value per step, a report on a bad step."""

    def __init__(
        self,
        enabled: bool,
        events: EventLog,
        rank: int,
        ignore: tuple[str, ...] = (),
        allow_masks: bool = True,
    ) -> None:
        self.enabled = enabled
        self.ignore = frozenset(ignore)
        """``ignore_inputs``: the batch entries left out of the check (and the masks found,
        ``forgive_masks``)."""
        self.allow_masks = allow_masks
        self._events = events
        self._rank = rank
        self._checked: deque[tuple[int, list[Any]]] = deque(maxlen=3)
        self._zero: Tensor | None = None

    def value(self, step: int, batches: Sequence[Any], device: torch.device) -> Tensor:
        """The step's input column (float64 scalar on ``device``): ``max |x|``, or 0 when
        the check is off or there are no batches."""
        if not self.enabled or not batches:
            if self._zero is None or self._zero.device != device:
                self._zero = torch.zeros((), dtype=torch.float64, device=device)
            return self._zero
        self._checked.append((step, list(batches)))
        return max_abs(float_tensors(batches, self.ignore), device)

    def foldable(
        self, step: int, batches: Sequence[Any], device: torch.device, keep: bool = True
    ) -> list[Tensor] | None:
        """The step's floating-point input tensors for a world of one's folded row (their
        norms taken in the gradients' fused pass, ``step/folded_row.py``): [] when the check is
        off or there are no batches, None unless every tensor is a strided float32, float16
        or bfloat16 tensor on ``device`` (then ``value``). ``keep`` False: the batches are not
        kept for a bad step's ``report`` (``single_process.py``: a bad step takes the full
        path)."""
        if not self.enabled or not batches:
            return []
        tensors = float_tensors(batches, self.ignore)
        for tensor in tensors:
            if tensor.device != device or not fused_takes(tensor):
                return None
        if keep:
            self._checked.append((step, list(batches)))
        return tensors

    def forgive_masks(
        self, agreement: Agreement, step: int, any_rank: Callable[[bool], bool]
    ) -> Agreement:
        """``GuardConfig.allow_masks``: a step whose only fault is its inputs, each of them on
        every rank an entry holding only 0 and -inf (an additive mask), is not bad: the
        agreement without its input ranks, those entries left out of the check from now on
        (``input_mask`` event, a warning). Every rank of such a step adds one one-value
        all-reduce (``any_rank``: does some rank hold another non-finite input?); a mask is
        found once, so a run pays it once per mask entry."""
        if not (self.allow_masks and agreement.input_ranks):
            return agreement
        if agreement.loss_ranks or agreement.grad_ranks:
            return agreement
        masks: list[str] = []
        if self._rank in agreement.input_ranks:
            batches = next((b for s, b in self._checked if s == step), [])
            found = batchtree.nonfinite_tensors(batches)  # a mask learned since: ignored now
            masks = [e["path"] for e in found if e["path"] and self._is_mask(e)]
            if not found or len(masks) < len(found):
                masks = []
        other = self._rank in agreement.input_ranks and not masks
        if any_rank(other):
            return agreement
        new = [path for path in masks if not batchpaths.is_ignored(path, self.ignore)]
        if new:
            paths = sorted(set(new))
            self.ignore = self.ignore | frozenset(paths)
            self._events.write("input_mask", step, paths=paths)
            names = tuple(dict.fromkeys(batchpaths.ignore_name(path) for path in paths))
            logger.warning(
                "trainguard: step %d rank %d: the input at %s holds only 0 and -inf, and the "
                "step's loss and gradients are finite on every rank: taken for an additive "
                "mask, not skipped, and left out of the input check from now on (to say so: "
                "inputs=InputConfig(ignore=%r), trainguard run: %s; "
                "InputConfig(allow_masks=False), trainguard run: --no-allow-masks, makes such "
                "a step bad)",
                step,
                self._rank,
                ", ".join(paths),
                names,
                " ".join(f"--ignore-inputs {shlex.quote(name)}" for name in names),
            )
        return dataclasses.replace(agreement, input_ranks=[])

    def _is_mask(self, entry: dict[str, Any]) -> bool:
        return bool(entry.get("additive_mask")) or batchpaths.is_ignored(entry["path"], self.ignore)

    def report(
        self,
        agreement: Agreement,
        step: int,
        drawn: SamplerDraws | None = None,
    ) -> None:
        """On a step with a non-finite input somewhere: a ``bad_input`` event on every rank
        (this rank's tensors named when the bad input is here, with their dataset indices:
        the batch's own, else those ``drawn()`` gives, the sampler's per micro-batch)."""
        if not agreement.input_ranks:
            return
        batches = next((b for s, b in self._checked if s == step), [])
        here: list[dict[str, Any]] = []
        if self._rank in agreement.input_ranks:
            here = self._nonfinite_here(batches, drawn() if drawn is not None else None)
        self._events.write("bad_input", step, ranks=agreement.input_ranks, tensors=here)
        for entry in here:
            logger.warning(
                "trainguard: step %d rank %d non-finite input at %s, samples %s%s%s",
                step,
                self._rank,
                entry["path"] or "<batch>",
                entry["positions"],
                f" (dataset indices {entry['dataset_indices']})"
                if "dataset_indices" in entry
                else "",
                mask_note(entry["path"]) if entry.get("additive_mask") else "",
            )

    def _nonfinite_here(
        self, batches: list[Any], drawn: list[list[int] | None] | None = None
    ) -> list[dict[str, Any]]:
        """``batchtree.nonfinite_tensors`` of the entries the check reads."""
        found = batchtree.nonfinite_tensors(batches, drawn)
        if not self.ignore:
            return found
        return [entry for entry in found if not batchpaths.is_ignored(entry["path"], self.ignore)]
