"""Reads of mask values: an op that turns a deliberate -inf into a real inf or NaN.

A mask writes -inf on purpose (masks.py). The ops that carry it keep it a mask value: an op
that only moves values (a view, reshape, cat, dtype cast), and a pointwise op or a row
normalization (``log_softmax``) whose non-finite outputs sit exactly where its masked input
is non-finite (``scores + bias``, ``-logp``, the log-probabilities of a row the mask covers
only partly). Any other op whose output is non-finite from mask values alone *reads* them:
the loss at a target the mask forbids (``nll_loss`` picking a -inf log-probability), a sum
or a matmul over masked logits. That op is the root, not the mask, with what it read
(:class:`MaskedRead`). A reduction over a row the mask covers entirely is ``masked_row``
(masks.py), checked first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from trainguard.replay.masks import op_name

MOVES = frozenset(
    f"aten.{name}"
    for name in (
        "view",
        "_unsafe_view",
        "reshape",
        "expand",
        "permute",
        "transpose",
        "t",
        "clone",
        "_to_copy",
        "contiguous",
        "slice",
        "select",
        "narrow",
        "unsqueeze",
        "squeeze",
        "flatten",
        "cat",
        "stack",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "alias",
        "detach",
        "as_strided",
        "copy_",
        "copy",
        "repeat",
        "repeat_interleave",
        "flip",
        "roll",
        "lift_fresh",
        "masked_fill",
        "index_fill",
        "index_put",
        "index_put_",
        "masked_scatter",
        "scatter",
        "scatter_",
        "fill",
        "fill_",
        "where",
    )
)
"""Ops that only move or write values: a mask value stays one."""

POSITIONAL = frozenset(("aten._log_softmax", "aten.log_softmax"))
"""Row normalizations that keep a partly masked row's -inf where they are."""

NLL = frozenset(("aten.nll_loss_forward", "aten.nll_loss2d_forward", "aten.nll_loss_nd"))


def keeps_mask(func: Any, bad: Sequence[Tensor], masked: Sequence[Tensor]) -> bool:
    """Whether an op's non-finite outputs ``bad``, computed from mask values (``masked``: its
    inputs holding them), are still mask values (module docstring)."""
    name = op_name(func)
    if name in MOVES:
        return True
    if name in POSITIONAL or torch.Tag.pointwise in getattr(func, "tags", ()):
        return sits_on(bad, masked)
    return False


def sits_on(bad: Sequence[Tensor], masked: Sequence[Tensor]) -> bool:
    """Every non-finite element of ``bad`` sits where some tensor of ``masked`` (broadcast to
    its shape) is non-finite."""
    for out in bad:
        covered = torch.zeros(out.shape, dtype=torch.bool, device=out.device)
        for mask in masked:
            try:
                covered |= torch.broadcast_to(~torch.isfinite(mask.detach()), out.shape).to(
                    out.device
                )
            except RuntimeError:
                continue
        if bool((~torch.isfinite(out.detach()) & ~covered).any()):
            return False
    return True


@dataclass(frozen=True)
class MaskedRead:
    """What an op read of a mask's values."""

    op: str
    shape: tuple[int, ...]
    """The shape of the input that holds the mask values."""
    masked: int
    """How many of its elements are mask values (non-finite)."""
    position: tuple[int, ...] | None = None
    """The first mask value read, where the op names it (a loss: its row and target)."""
    row_masked: int | None = None
    """How many positions of that row are masked ..."""
    row_size: int | None = None
    """... of how many."""
    value: str = "-inf"
    how: str = "the target of"
    """What the position is to its row: ``the target of`` (a loss), ``gathered for``."""

    @property
    def row(self) -> int | None:
        """The position's index along the input's leading dimension."""
        return self.position[0] if self.position else None

    def text(self) -> str:
        """E.g. ``it read -inf at [13, 4] (the target of row 13): 3 of 6 positions of that row
        are masked (74 of 240 elements in all)``."""
        total = 1
        for size in self.shape:
            total *= size
        overall = f"{self.masked} of {total} elements of {list(self.shape)} masked"
        if self.position is None:
            return (
                f"it read {self.value} values that a mask wrote ({overall}; no row masked entirely)"
            )
        row = self.position[0]
        where = f"at {list(self.position)} ({self.how} row {row})"
        part = f"{self.row_masked} of {self.row_size} positions of that row are masked"
        return f"it read {self.value} {where}: {part} ({overall})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "shape": list(self.shape),
            "masked": self.masked,
            "position": list(self.position) if self.position is not None else None,
            "row_masked": self.row_masked,
            "row_size": self.row_size,
            "value": self.value,
            "how": self.how,
        }


def masked_read(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], masked: Tensor
) -> MaskedRead:
    """What ``func`` read of ``masked`` (an input holding mask values): the first masked
    target of a negative log-likelihood, else how much of it is masked."""
    data = masked.detach()
    bad = ~torch.isfinite(data)
    name = op_name(func)
    first = data[bad][0] if bool(bad.any()) else torch.tensor(float("-inf"))
    value = "nan" if bool(torch.isnan(first)) else ("inf" if float(first) > 0 else "-inf")
    read = MaskedRead(name, tuple(data.shape), int(bad.sum()), value=value)
    if name in NLL and len(args) >= 2 and args[0] is masked and isinstance(args[1], Tensor):
        ignore = args[4] if len(args) > 4 and isinstance(args[4], int) else -100
        return _nll_read(read, data, bad, args[1], ignore)
    if name == "aten.gather" and len(args) >= 3 and args[0] is masked:
        dim, index = args[1], args[2]
        if isinstance(dim, int) and isinstance(index, Tensor):
            return _gather_read(read, bad, dim % max(data.dim(), 1), index)
    return read


def _gather_read(read: MaskedRead, bad: Tensor, dim: int, index: Tensor) -> MaskedRead:
    """The first position ``gather`` picked that the mask covers."""
    hit = bad.gather(dim, index.to(bad.device))
    where = hit.nonzero()
    if not where.numel():
        return read
    first = [int(i) for i in where[0].tolist()]
    position = list(first)
    position[dim] = int(index[tuple(first)])
    row: tuple[int | slice, ...] = tuple(
        slice(None) if d == dim else p for d, p in enumerate(first)
    )
    masked_row = bad[row]
    return replace(
        read,
        position=tuple(position),
        row_masked=int(masked_row.sum()),
        row_size=int(masked_row.numel()),
        how="gathered for",
    )


def _nll_read(
    read: MaskedRead, logp: Tensor, bad: Tensor, target: Tensor, ignore: int
) -> MaskedRead:
    """The first row whose target class the mask covers (class dim 1; target without it)."""
    if logp.dim() < 2 or target.dim() != logp.dim() - 1:
        return read
    index = target.clamp(min=0).unsqueeze(1).to(logp.device)
    hit = bad.gather(1, index).squeeze(1) & (target.to(logp.device) != ignore)
    where = hit.nonzero()
    if not where.numel():
        return read
    first = [int(i) for i in where[0].tolist()]
    row: tuple[int | slice, ...] = (first[0], slice(None), *first[1:])
    position = (first[0], int(target[tuple(first)]), *first[1:])
    masked_row = bad[row]
    return MaskedRead(
        read.op,
        read.shape,
        read.masked,
        position,
        int(masked_row.sum()),
        int(masked_row.numel()),
        read.value,
    )
