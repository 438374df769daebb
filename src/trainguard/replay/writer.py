"""Which update wrote weights that were non-finite before the step, and through what.

The evidence a bundle holds: its history (``history.json``: every recent step's decision,
losses, gradient norm and the learning rate of every param group, ``lrs``), and the
optimizer's state (its param groups' hyper-parameters, Adam's moments...). The last step
before the bad one whose update was applied (decision ``ok``) wrote the weights the bad step
read; when its loss and gradient norm were finite, its forward read those weights finite and
its gradients were finite, so its *update* made them non-finite. Then: the param group that
holds exactly the non-finite parameters, a hyper-parameter of that group that was not finite
(its ``lr`` in that step's history record, or any hyper-parameter in the bundle's optimizer
state), and whether the optimizer's moments of those parameters are finite (a non-finite
gradient would have made them non-finite too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from trainguard.events import number
from trainguard.replay.optimizer import Hyper, OptimizerView, ParamGroup
from trainguard.replay.values import format_number

APPLIED = ("ok", "warn")
"""History decisions whose update was (``ok``) or may have been applied (``warn``: the guard
only warned; a loop that steps anyway applies it)."""


def record_lrs(record: dict[str, Any]) -> list[float | None]:
    """A history record's learning rate of every param group (``lrs``; only group 0's ``lr``
    in records written before ``lrs`` was)."""
    lrs = record.get("lrs")
    if isinstance(lrs, list):
        return [number(v) for v in lrs]
    return [number(record.get("lr"))]


@dataclass
class Writer:
    """The update that wrote the non-finite weights, as far as the evidence goes."""

    step: int | None = None
    """The last applied step before the bad one (None: no history)."""
    decision: str | None = None
    """That step's decision (``ok``, or ``warn``: applied by the loop anyway)."""
    loss: float | None = None
    grad_norm: float | None = None
    group: ParamGroup | None = None
    """The param group holding the non-finite parameters (all of them)."""
    exact: bool = False
    """... which are exactly that group's parameters."""
    hypers: list[Hyper] = field(default_factory=list)
    """Non-finite hyper-parameters of that group (of any group when it is not known)."""
    from_history: bool = False
    """``hypers`` come from the writer step's history record (else the optimizer state)."""
    moments: str = "unknown"
    """The optimizer's state of the non-finite parameters: ``finite``, ``nonfinite``,
    ``none`` (it keeps none: plain SGD) or ``unknown`` (not matched to names)."""
    moment_names: list[str] = field(default_factory=list)
    before_any_update: bool = False
    """No update of the run came before the step: the history holds every step from the
    run's first (step 0) and none before this one was applied (or this is step 0)."""

    @property
    def finite_before(self) -> bool:
        """The writer step's loss and gradient norm were finite."""
        return all(v is not None and math.isfinite(v) for v in (self.loss, self.grad_norm))

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "decision": self.decision,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "group": self.group.index if self.group else None,
            "group_size": self.group.size if self.group else None,
            "exact": self.exact,
            "hyperparameters": [h.to_dict() for h in self.hypers],
            "from_history": self.from_history,
            "before_any_update": self.before_any_update,
            "moments": self.moments,
            "moment_names": self.moment_names,
        }


def find_writer(
    bad: Sequence[str],
    shapes: dict[str, tuple[int, ...]],
    step: int | None,
    history: list[dict[str, Any]] | None,
    view: OptimizerView | None,
) -> Writer:
    """The evidence about the update that wrote ``bad`` (parameter names, with ``shapes``)
    before step ``step`` (module docstring)."""
    found = Writer()
    record = _applied_before(history or [], step)
    found.before_any_update = record is None and _from_the_start(history or [], step)
    if record is not None:
        found.step = record.get("step")
        found.decision = record.get("decision")
        losses = [number(v) for v in record.get("losses") or []]
        finite = [v for v in losses if v is not None]
        found.loss = max(finite, key=abs) if finite and len(finite) == len(losses) else None
        found.grad_norm = number(record.get("grad_norm"))
    if view is None:
        return found
    found.group, found.exact = _group(bad, view)
    found.hypers, found.from_history = _hypers(found.group, record, view, len(bad))
    if found.group is None and found.hypers:
        found.group = view.groups[found.hypers[0].group]
        found.exact = found.group.size == len(bad) and found.group.names is None
    found.moments, found.moment_names = _moments(bad, shapes, view)
    return found


def _from_the_start(history: list[dict[str, Any]], step: int | None) -> bool:
    """The history holds every step of the run up to ``step``: it is step 0, or the records
    run from step 0 to it without a gap."""
    if step is None or step <= 0:
        return step == 0
    steps = sorted({r["step"] for r in history if isinstance(r.get("step"), int)})
    return [s for s in steps if s < step] == list(range(step))


def _applied_before(history: list[dict[str, Any]], step: int | None) -> dict[str, Any] | None:
    earlier = [
        r for r in history if isinstance(r.get("step"), int) and (step is None or r["step"] < step)
    ]
    return next((r for r in reversed(earlier) if r.get("decision") in APPLIED), None)


def _group(bad: Sequence[str], view: OptimizerView) -> tuple[ParamGroup | None, bool]:
    holding = {id(g): g for name in bad if (g := view.group_of(name)) is not None}
    if len(holding) != 1 or any(view.group_of(name) is None for name in bad):
        return None, False
    (group,) = holding.values()
    return group, set(group.names or []) == set(bad)


def _hypers(
    group: ParamGroup | None,
    record: dict[str, Any] | None,
    view: OptimizerView,
    count: int,
) -> tuple[list[Hyper], bool]:
    """Non-finite hyper-parameters: the group's lr in the writer step's record, else in the
    optimizer state; of the group holding the parameters, or (names unknown) of a group of
    as many parameters."""
    fits = [group] if group is not None else [g for g in view.groups if g.size == count]
    indices = {g.index for g in fits}
    if record is not None:
        lrs = record_lrs(record)
        found = [
            Hyper(i, "lr", v)
            for i, v in enumerate(lrs)
            if v is not None and not math.isfinite(v) and i in indices
        ]
        if found:
            return found, True
    return [h for h in view.nonfinite() if h.group in indices], False


def _moments(
    bad: Sequence[str], shapes: dict[str, tuple[int, ...]], view: OptimizerView
) -> tuple[str, list[str]]:
    if view.matched == "none":
        return "unknown", []
    names: set[str] = set()
    finite = True
    for param in bad:
        for key, value in (view.state_of(param) or {}).items():
            if isinstance(value, Tensor) and tuple(value.shape) == shapes.get(param):
                names.add(key)
                finite &= bool(value.isfinite().all()) if value.is_floating_point() else True
    if not names:
        return "none", []
    return ("finite" if finite else "nonfinite"), sorted(names)


def group_text(group: ParamGroup, exact: bool, bad: Sequence[str]) -> str:
    """``param group 1 (2 parameters: head.weight, head.bias)``."""
    names = group.names or []
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    noun = "parameter" if group.size == 1 else "parameters"
    text = f"param group {group.index} ({group.size} {noun}{': ' + shown if shown else ''})"
    if exact:
        return text + (", exactly the non-finite ones" if len(bad) > 1 else ", the non-finite one")
    return text


def hypers_text(hypers: Sequence[Hyper], verb: str = "") -> str:
    """``lr nan`` / ``lr nan, weight_decay inf`` (``verb``: ``lr was nan``)."""
    sep = f" {verb} " if verb else " "
    return ", ".join(f"{h.name}{sep}{format_number(h.value)}" for h in hypers)


def step_text(found: Writer) -> str:
    """``loss 1.0213, gradient norm 0.8312``."""
    loss = format_number(found.loss) if found.loss is not None else "not recorded"
    norm = format_number(found.grad_norm) if found.grad_norm is not None else "not recorded"
    return f"loss {_short(loss)}, gradient norm {_short(norm)}"


def _short(text: str) -> str:
    try:
        return f"{float(text):.6g}"
    except ValueError:
        return text


def pending_summary(
    hypers: Sequence[Hyper],
    view: OptimizerView,
    step: int | None,
    history: list[dict[str, Any]] | None,
) -> str:
    """A step whose optimizer state holds non-finite hyper-parameters, stopped before its
    optimizer step (the guard's hyper-parameter check): what that step would have written."""
    groups = sorted({h.group for h in hypers})
    parts = []
    for index in groups:
        values = hypers_text([h for h in hypers if h.group == index], "is")
        parts.append(f"param group {index}'s {values}")
    at = f" at step {step}" if step is not None else ""
    recorded = _recorded(history, step, groups)
    first = view.groups[groups[0]]
    into = group_text(first, False, []) if len(groups) == 1 else "their parameters"
    return (
        f"{'; '.join(parts)[:1].upper()}{'; '.join(parts)[1:]}{at} (the optimizer state in "
        f"the bundle{recorded}): the optimizer step would have written non-finite values into "
        f"{into}, and the guard stopped the step before it."
    )


def _recorded(history: list[dict[str, Any]] | None, step: int | None, groups: list[int]) -> str:
    """``; history.json: lr nan`` when the step's history record holds those groups' lr."""
    record = next((r for r in reversed(history or []) if r.get("step") == step), None)
    if record is None or "lrs" not in record:
        return ""
    lrs = record_lrs(record)
    shown = [format_number(lrs[g]) for g in groups if g < len(lrs) and lrs[g] is not None]
    return f"; history.json: lr {', '.join(shown)}" if shown else ""
