"""The evidence that a run diverged before its bad step, for the ``divergence`` verdict
(``verdicts.classify``): from the bundle's history (``history.json``: every step's losses,
gradient norm and learning rate) and the weights before the step.

- ``growth``: the loss or the gradient norm grew ``GROWTH`` times or more over the recent
  steps (two finite steps are enough) up to its last finite value.
- ``runaway``: the updates ran away: the learning rate jumped ``LR_JUMP`` times in one of the
  last ``LR_JUMP_STEPS`` updates, or a weight before the step is past ``RUNAWAY_WEIGHT``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

GROWTH = 10.0
"""How much the loss or gradient norm must have grown over the history to call it divergence."""


@dataclass
class Growth:
    """How a metric grew over the recent steps before the bad one."""

    metric: str
    """``grad_norm`` or ``loss``."""
    start: float
    end: float
    steps: int
    first_step: int | None
    last_step: int | None

    @property
    def factor(self) -> float:
        """``end / start``; from 0: infinite when it rose, 1 when it stayed at 0."""
        if self.start > 0:
            return self.end / self.start
        return math.inf if self.end > 0 else 1.0

    def text(self) -> str:
        name = "gradient norm" if self.metric == "grad_norm" else "loss"
        return (
            f"the {name} grew {self.factor:.3g}x over the last {self.steps} steps (from "
            f"{self.start:.4g} at step {self.first_step} to {self.end:.4g} at step "
            f"{self.last_step}) before it overflowed"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "start": self.start,
            "end": self.end,
            "factor": self.factor,
            "steps": self.steps,
            "first_step": self.first_step,
            "last_step": self.last_step,
        }


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _series(records: list[dict[str, Any]], metric: str) -> list[tuple[int | None, float]]:
    out = []
    for record in records:
        if metric == "grad_norm":
            value = _number(record.get("grad_norm"))
        else:
            losses = [_number(v) for v in record.get("losses") or []]
            finite = [abs(v) for v in losses if v is not None]
            value = max(finite) if finite and len(finite) == len(losses) else None
        if value is not None:
            out.append((record.get("step"), value))
    return out


def growth(history: list[dict[str, Any]] | None, window: int = 64) -> Growth | None:
    """The loss's or the gradient norm's growth before the bad step, when it diverged: it
    grew at least ``GROWTH`` times from the window's low to its last finite value, the last
    value being the window's highest (two finite steps are enough: an early blow-up is one
    too)."""
    if not history or len(history) < 3:
        return None
    before = history[:-1][-window:]
    best: Growth | None = None
    for metric in ("grad_norm", "loss"):
        series = _series(before, metric)
        if len(series) < 2:
            continue
        low = min(range(len(series)), key=lambda i: series[i][1])
        (first, start), (last, end) = series[low], series[-1]
        if end < max(v for _, v in series) or low == len(series) - 1 or end <= start:
            continue  # not its highest at the end, or flat (a gradient norm 0 all along)
        found = Growth(metric, start, end, len(series) - low, first, last)
        if found.factor >= GROWTH and (best is None or found.factor > best.factor):
            best = found
    return best


LR_JUMP = 10.0
"""A learning rate this many times its value one step before is a jump (a warm-up grows it
by far less a step)."""


LR_JUMP_STEPS = 3
"""A jump in the last this many updates before the bad step counts."""


RUNAWAY_WEIGHT = 1e4
"""A finite weight this large before the step: the updates ran away (trained weights are of
order one; an embedding or a norm's scale rarely reaches 100)."""


@dataclass
class Runaway:
    """The updates ran away before the bad step: the learning rate jumped, the weights grew
    past ``RUNAWAY_WEIGHT``, or both (``runaway``)."""

    lr: float | None
    """The learning rate of the last update before the bad step (history.json)."""
    lr_before: float | None = None
    """The learning rate one update before a jump (None: no jump)."""
    jump_step: int | None = None
    """The step whose update ran at the jumped learning rate."""
    weight: float | None = None
    """The largest finite |weight| before the step, when past ``RUNAWAY_WEIGHT``."""
    param: str | None = None

    def text(self) -> str:
        said = []
        if self.lr_before is not None and self.lr is not None:
            said.append(
                f"the learning rate jumped {self.lr / self.lr_before:.3g}x at step "
                f"{self.jump_step} (from {self.lr_before:.3g} to {self.lr:.3g})"
            )
        elif self.lr is not None:
            said.append(f"the learning rate was {self.lr:.3g}")
        if self.weight is not None:
            said.append(f"the weights reached |w| = {self.weight:.3g} ({self.param})")
        return " and ".join(said)

    def to_dict(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "lr_before": self.lr_before,
            "jump_step": self.jump_step,
            "largest_weight": self.weight,
            "param": self.param,
        }


def runaway(
    history: list[dict[str, Any]] | None, largest: tuple[str, float] | None
) -> Runaway | None:
    """Whether the updates before the bad step ran away: a learning-rate jump (``LR_JUMP``
    times the step before, in the last ``LR_JUMP_STEPS`` updates) or a weight past
    ``RUNAWAY_WEIGHT`` (``largest``: the largest finite |weight| and its parameter)."""
    records = [r for r in (history or [])[:-1] if _number(r.get("lr")) is not None]
    lr = _number(records[-1].get("lr")) if records else None
    jump = None
    for before, after in itertools.pairwise(records[-LR_JUMP_STEPS - 1 :]):
        low, high = _number(before.get("lr")), _number(after.get("lr"))
        if low and high and low > 0 and high >= LR_JUMP * low:
            jump = (low, after.get("step"))
    big = largest if largest is not None and largest[1] >= RUNAWAY_WEIGHT else None
    if jump is None and big is None:
        return None
    return Runaway(
        lr,
        jump[0] if jump else None,
        jump[1] if jump else None,
        big[1] if big else None,
        big[0] if big else None,
    )
