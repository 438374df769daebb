"""Masks: values written on purpose, and reductions over rows that are masked entirely.

An attention or padding mask writes ``-inf`` (or a huge finite value: ``-1e9``,
``torch.finfo(dtype).min``) with ``masked_fill`` / ``where`` / ``fill_`` / ``full``. Such a
value is no cause of its own, nor is the overflow it makes on the way (``finfo.min +
finfo.min = -inf``, ``-1e9`` cast to float16). What turns a mask into a NaN is a reduction
over a row that the mask covers entirely: softmax of a row of ``-inf`` is ``0/0``, its
logsumexp, max, sum or mean is ``-inf``. That reduction is the root, and the row names the
sample (its index along the leading dimension) whose every element was masked.

The tracer (localize.py) asks this module three things: does an op write a mask value
(:func:`mask_constant`), are an op's non-finite outputs only overflowed mask values
(:func:`explained_by_masks`), and does a reduction see a fully masked row
(:func:`fully_masked_row`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

HUGE = float(torch.finfo(torch.float16).max)
"""A fill constant at least this large (65504) is meant as infinity: it overflows float16."""

MASK_WRITERS = frozenset(
    f"aten.{name}"
    for name in (
        "masked_fill",
        "where",
        "fill",
        "full",
        "full_like",
        "new_full",
        "index_fill",
        "scalar_tensor",
    )
)
"""Ops whose constant argument, when infinite or huge, is a mask value written on purpose."""

ROW_REDUCTIONS = frozenset(
    f"aten.{name}"
    for name in (
        "_softmax",
        "_log_softmax",
        "softmax",
        "log_softmax",
        "logsumexp",
        "max",
        "amax",
        "min",
        "amin",
        "mean",
        "sum",
    )
)
"""Reductions that turn a row of masked values into a non-finite value."""


def op_name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", func)
    return f"aten.{getattr(packet, '__name__', str(packet))}"


def is_huge(value: float) -> bool:
    return not math.isfinite(value) or abs(value) >= HUGE


def writes_masks(func: Any) -> bool:
    """The op is one that writes masks (``masked_fill``, ``where``, ``fill_``, ``full``...)."""
    return op_name(func) in MASK_WRITERS


def mask_constant(func: Any, flat_args: Sequence[Any]) -> float | None:
    """The infinite or huge constant a mask-writing op writes, or None."""
    if not writes_masks(func):
        return None
    for arg in flat_args:
        if isinstance(arg, float) and is_huge(arg):
            return arg
    return None


def holds_huge(t: Tensor) -> bool:
    """Any element is ±inf or at least ``HUGE`` in magnitude."""
    data = t.detach()
    return bool(((data.abs() >= HUGE) & ~torch.isnan(data)).any())


def explained_by_masks(bad: Sequence[Tensor], masks: Sequence[Tensor]) -> bool:
    """Every non-finite element of ``bad`` sits where some mask-holding input (``masks``,
    broadcast to its shape) holds a huge value: only mask values overflowed."""
    if not masks:
        return False
    for out in bad:
        covered = torch.zeros(out.shape, dtype=torch.bool, device=out.device)
        for mask in masks:
            data = mask.detach()
            try:
                huge = torch.broadcast_to((data.abs() >= HUGE) & ~torch.isnan(data), out.shape)
            except RuntimeError:
                continue
            covered |= huge.to(out.device)
        if bool((~torch.isfinite(out.detach()) & ~covered).any()):
            return False
    return True


@dataclass(frozen=True)
class MaskedRow:
    """A reduction's row whose every element was non-finite (masked)."""

    op: str
    dims: tuple[int, ...]
    """The reduced dimensions of the input."""
    shape: tuple[int, ...]
    """The input's shape."""
    index: tuple[int, ...]
    """The first fully masked row: its index over the kept dimensions."""
    rows: int
    """How many rows were masked entirely."""
    total: int
    """How many rows the reduction has."""
    value: str
    """The masked elements' value (``-inf``, ``nan``...)."""

    @property
    def sample(self) -> int | None:
        """The row's index along the leading dimension (when that one is not reduced)."""
        return self.index[0] if self.index and 0 not in self.dims else None

    def text(self) -> str:
        """E.g. ``row [2, 0, 1] of [4, 2, 5, 5] over dim 3 holds only -inf (1 of 40 rows)``."""
        dims = ", ".join(map(str, self.dims))
        noun = "dim" if len(self.dims) == 1 else "dims"
        return (
            f"row {list(self.index)} of {list(self.shape)} over {noun} {dims} holds only "
            f"{self.value} ({self.rows} of {self.total} rows fully masked)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "dims": list(self.dims),
            "shape": list(self.shape),
            "index": list(self.index),
            "rows": self.rows,
            "total": self.total,
            "value": self.value,
        }


def fully_masked_row(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> MaskedRow | None:
    """The first row of a reduction's input whose every element is non-finite, or None."""
    name = op_name(func)
    if name not in ROW_REDUCTIONS or not args or not isinstance(args[0], Tensor):
        return None
    x = args[0].detach()
    if not x.is_floating_point() or x.dim() == 0 or not x.numel():
        return None
    dims = _reduced_dims(func, args, kwargs, x.dim())
    if dims is None:
        return None
    full = ~torch.isfinite(x)
    for d in sorted(dims, reverse=True):
        full = full.all(dim=d)
    if not bool(full.any()):
        return None
    where = full.nonzero()
    index = tuple(int(i) for i in where[0].tolist()) if where.numel() else ()
    first = x.permute(*[d for d in range(x.dim()) if d not in dims], *dims)[index].reshape(-1)[0]
    value = float(first.item())
    shown = "nan" if math.isnan(value) else ("-inf" if value < 0 else "inf")
    total = max(full.numel(), 1)
    return MaskedRow(name, dims, tuple(x.shape), index, int(full.sum()), total, shown)


def _reduced_dims(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], ndim: int
) -> tuple[int, ...] | None:
    """The dimensions a reduction reduces (all of them when it names none)."""
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    value: Any = None
    if "dim" in names:
        i = names.index("dim")
        value = args[i] if i < len(args) else kwargs.get("dim")
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return tuple(range(ndim))
    values = [value] if isinstance(value, int) else list(value)
    if not all(isinstance(v, int) for v in values):
        return None
    return tuple(sorted({v % ndim for v in values}))
