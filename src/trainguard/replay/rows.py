"""Non-finite rows of a table from before the step: which rows, which of them an op read, and
whether an update ever touched them.

An embedding or position table, per-class output rows, per-expert weights: a table whose rows
only some inputs index. When some of its rows are non-finite before the step (a table grown
by copying chunks whose tail was never initialised), only the samples that read those rows
make the step non-finite. The tracer notes the rows an index op read (:func:`rows_read`); the
diagnosis names the table's non-finite rows (:func:`bad_rows`) and says whether the
optimizer ever updated them (:func:`row_updates`, from its per-row state: Adam's moments of a
row that no gradient ever reached are exactly 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from trainguard.replay.masks import op_name

MAX_ROWS = 1024
"""At most this many row indices are kept (the count is always exact)."""


def _table_and_index(name: str, args: Sequence[Any]) -> tuple[Any, Any] | None:
    """The table an index op reads (rows along dim 0) and the indices it reads them with."""
    if name in ("aten.embedding", "aten._embedding_bag", "aten._embedding_bag_forward_only"):
        return (args[0], args[1]) if len(args) > 1 else None
    if name == "aten.index_select" and len(args) > 2 and args[1] == 0:
        return args[0], args[2]
    if name == "aten.index" and len(args) > 1 and isinstance(args[1], (list, tuple)) and args[1]:
        return args[0], args[1][0]
    return None


def rows_read(func: Any, args: Sequence[Any], table: Tensor) -> list[int] | None:
    """The non-finite rows of ``table`` that an index op (embedding, index_select along dim
    0, ``table[idx]``) read; None when ``func`` is no such read of ``table``."""
    found = _table_and_index(op_name(func), args)
    if found is None or found[0] is not table or not isinstance(found[1], Tensor):
        return None
    index = found[1]
    if index.dtype == torch.bool or index.is_floating_point():
        return None
    bad = _bad_row_mask(table)
    picked = torch.unique(index.detach().reshape(-1).to(bad.device))
    picked = picked[(picked >= -bad.numel()) & (picked < bad.numel())] % max(bad.numel(), 1)
    hits = picked[bad[picked]]
    return [int(i) for i in hits.tolist()[:MAX_ROWS]]


def _bad_row_mask(table: Tensor) -> Tensor:
    data = table.detach()
    if data.dim() == 0:
        return (~torch.isfinite(data)).reshape(1)
    return (~torch.isfinite(data)).reshape(data.shape[0], -1).any(dim=1)


def lead_rows(tensor: Tensor) -> list[int]:
    """The indices along the leading dimension that hold a non-finite value."""
    if tensor.dim() == 0:
        return []
    found = _bad_row_mask(tensor).nonzero().flatten()
    return [int(i) for i in found[:MAX_ROWS].tolist()]


def spans(indices: Sequence[int]) -> str:
    """``32..63`` / ``3, 4, 7, 9..11``: sorted indices, runs of three or more joined."""
    values = sorted(set(indices))
    parts: list[str] = []
    start = prev = None
    for value in [*values, None]:
        if value is not None and prev is not None and value == prev + 1:
            prev = value
            continue
        if start is not None and prev is not None:
            if prev - start >= 2:
                parts.append(f"{start}..{prev}")
            else:
                parts.extend(str(i) for i in range(start, prev + 1))
        start = prev = value
    shown = ", ".join(parts[:8])
    return shown + (", ..." if len(parts) > 8 else "")


@dataclass
class RowSet:
    """A tensor's non-finite rows (along dim 0)."""

    name: str
    indices: list[int]
    count: int
    total: int
    shape: list[int] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        """Some rows are non-finite, not all of them."""
        return 0 < self.count < self.total

    def text(self) -> str:
        noun = "row" if self.count == 1 else "rows"
        return f"{noun} {spans(self.indices)} of {self.name} ({self.count} of {self.total} rows)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rows": self.indices,
            "count": self.count,
            "total": self.total,
            "shape": self.shape,
            "text": self.text(),
        }


def bad_rows(name: str, tensor: Tensor) -> RowSet:
    mask = _bad_row_mask(tensor)
    found = mask.nonzero().flatten()
    indices = [int(i) for i in found[:MAX_ROWS].tolist()]
    return RowSet(name, indices, int(mask.sum()), int(mask.numel()), list(tensor.shape))


@dataclass
class RowUpdates:
    """Whether the optimizer ever updated some rows of a parameter, from its per-row state."""

    status: str
    """``never`` (its state of those rows is 0: no gradient ever reached them), ``nonfinite``
    (its state there is non-finite: a non-finite gradient reached them), ``updated``
    (non-zero and finite) or ``unknown`` (no per-row state: plain SGD, or no optimizer)."""
    state: list[str] = field(default_factory=list)
    """The state tensors read (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...)."""
    steps: int | None = None
    """The optimizer's step count for the parameter, when it keeps one."""

    def text(self) -> str:
        names = " and ".join(self.state)
        after = f" after {self.steps} steps" if self.steps else ""
        if self.status == "never":
            return (
                f"they were never updated: the optimizer's {names} of those rows are 0{after} "
                "(no gradient ever reached them), so they have been non-finite since the table "
                "was made or loaded, not written by an update"
            )
        if self.status == "nonfinite":
            return (
                f"the optimizer's {names} of those rows are non-finite: a non-finite gradient "
                "reached them in an earlier update"
            )
        if self.status == "updated":
            return (
                f"earlier updates touched them (the optimizer's {names} of those rows are non-zero)"
            )
        return (
            "whether an update ever touched them is unknown (the optimizer keeps no per-row "
            "state for it)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "state": self.state, "steps": self.steps}


def row_updates(
    rows: Sequence[int], shape: Sequence[int], state: dict[str, Any] | None
) -> RowUpdates:
    """Whether ``rows`` of a parameter of ``shape`` were ever updated, from the optimizer's
    state of that parameter (``state``: ``{"exp_avg": tensor, "step": ...}``; None: none)."""
    tensors = {
        k: v
        for k, v in (state or {}).items()
        if isinstance(v, Tensor) and list(v.shape) == list(shape) and v.is_floating_point()
    }
    steps = _steps((state or {}).get("step"))
    if not tensors or not rows:
        return RowUpdates("unknown", steps=steps)
    index = torch.tensor(list(rows), dtype=torch.long)
    picked = [t.detach().reshape(t.shape[0], -1)[index] for t in tensors.values()] if shape else []
    if not picked:
        return RowUpdates("unknown", steps=steps)
    if any(not bool(torch.isfinite(p).all()) for p in picked):
        status = "nonfinite"
    elif all(not bool(p.any()) for p in picked):
        status = "never"
    else:
        status = "updated"
    return RowUpdates(status, sorted(tensors), steps)


def _steps(value: Any) -> int | None:
    if isinstance(value, Tensor) and value.numel() == 1:
        return int(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    return None
