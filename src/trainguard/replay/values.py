"""A tensor's non-finite values as the diagnosis states them: which elements, how they are
written (``nan``, ``inf``, ``-inf``), and the operands of a pointwise op at one index."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from trainguard.numerics import coalesced, is_sparse, stored_values


def float_tensors(tree: Any) -> list[Tensor]:
    flat, _ = tree_flatten(tree)
    return [
        t
        for t in flat
        if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel()
    ]


def all_finite(t: Tensor) -> bool:
    return bool(torch.isfinite(stored_values(t)).all())


def has_nan(t: Tensor) -> bool:
    return bool(torch.isnan(stored_values(t)).any())


def first_nonfinite(t: Tensor, nan_first: bool = False) -> tuple[list[int], float, int]:
    """Index and value of the first non-finite element (complex: its modulus), and the count
    of non-finite elements. ``nan_first``: the first NaN when there is one. A sparse tensor
    (a graph's features or adjacency) is read through its stored values; the index is the
    dense one."""
    if is_sparse(t):
        coo = coalesced(t)
        index, value, count = first_nonfinite(coo.values(), nan_first)
        if index:  # the stored value's position, then its dense dimensions (hybrid COO)
            index = [int(i) for i in coo.indices()[:, index[0]].tolist()] + index[1:]
        return index, value, count
    data = t.detach()
    data = data.abs() if data.is_complex() else data
    mask = ~torch.isfinite(data)
    nans = torch.isnan(data) if nan_first else mask
    where = nans.nonzero() if bool(nans.any()) else mask.nonzero()
    index = [int(i) for i in where[0].tolist()] if where.numel() else []
    return index, float(data[tuple(index)].item()), int(mask.sum())


def value_name(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def format_number(value: Any) -> str:
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else value_name(value)
    return repr(value)


def operand_at(arg: Any, shape: torch.Size, index: list[int]) -> str | None:
    if isinstance(arg, Tensor):
        try:
            item = torch.broadcast_to(arg.detach(), shape)[tuple(index)].item()
        except (RuntimeError, IndexError):
            return None
        return format_number(float(item) if isinstance(item, (int, float)) else item)
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return format_number(arg)
    return None


def op_detail(
    func: Any,
    flat_args: list[Any],
    out: Tensor,
    found: tuple[list[int], float, int],
    before: dict[int, Tensor] | None = None,
) -> str:
    """``aten.div(0.0, 0.0) = nan at [3, 0], 1 of 8 elements`` (a pointwise op: its operands
    at that index), else ``aten.addmm gave inf at [5, 0], 4 of 32 elements``. ``found``:
    ``first_nonfinite(out)``; ``before``: copies of the tensors an in-place op wrote, by
    ``id`` of the tensor, taken before it ran (its operands as they were)."""
    index, value, count = found
    where = f"at {index}, {count} of {out.numel()} elements" if index else "(a scalar)"
    op = f"aten.{getattr(getattr(func, 'overloadpacket', func), '__name__', func)}"
    if torch.Tag.pointwise not in getattr(func, "tags", ()):
        return f"{op} gave {value_name(value)} {where}"
    shown_args = [(before or {}).get(id(a), a) if isinstance(a, Tensor) else a for a in flat_args]
    operands = [operand_at(a, out.shape, index) for a in shown_args]
    shown = [o for o in operands if o is not None]
    return f"{op}({', '.join(shown)}) = {value_name(value)} {where}"
