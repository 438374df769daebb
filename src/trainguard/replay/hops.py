"""The tracer's records: where a non-finite value came from (:class:`Origin`) and the hops it
took on its way to the step's output (:class:`Hop`).

An origin is a *root*: an op that made a non-finite value from finite inputs (``op``), a
mask value written on purpose (``constant``), a value in the batch (``input``), in the weights
or buffers (``parameter``), or in a tensor made before the step outside the model and the
batch (``external``: a loss module's ``weight``, a tensor the loop made). Values the tracer
cannot place are ``untracked``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from trainguard.replay.sites import OpSite

if TYPE_CHECKING:
    from trainguard.replay.masked_reads import MaskedRead
    from trainguard.replay.masks import MaskedRow

SEEDED = ("input", "parameter", "external")
"""Origins tagged before the ops run: values that were non-finite before the step."""

NOT_ROOTS = ("constant", "untracked")
"""Roots that are no cause of their own: ``masked_fill(mask, -inf)`` is deliberate."""


@dataclass
class Origin:
    """Where a non-finite value came from."""

    kind: str
    """``op``, ``constant``, ``input``, ``parameter``, ``external`` or ``untracked`` (module
    docstring)."""
    value: str
    """``nan``, ``inf`` or ``-inf``: the first non-finite value."""
    site: OpSite | None = None
    label: str | None = None
    """Values from before the step: what holds it (``batch['x']``, ``encoder.fc.weight``,
    ``CrossEntropyLoss.weight``, ``argument weight of aten.nll_loss_forward``)."""
    detail: str | None = None
    """E.g. ``aten.div(0.0, 0.0) = nan at [3] (1 of 4 elements)``."""
    inputs_finite: bool = True
    """Every input of the op was finite (False: it held ±inf but no NaN)."""
    masked_row: MaskedRow | None = None
    """A reduction over a row that a mask covered entirely: that row."""
    masked_read: MaskedRead | None = None
    """An op that read positions a mask set to -inf, in rows the mask covers only partly."""


@dataclass(eq=False)
class Hop:
    """One non-finite value on its way from a root to the step's output: the op that made
    it and the non-finite value it was computed from (``parent``; None at a root)."""

    origin: Origin
    """The root this value comes from (through ``parent``)."""
    site: OpSite | None
    value: str
    shape: list[int]
    dtype: str
    parent: Hop | None = None
    roots: tuple[Origin, ...] = ()
    """Every root whose non-finite values reached this value."""
    nan_maker: Origin | None = None
    """The op on the way that turned ±inf into NaN (None: the root made NaN itself)."""
    lead: list[int] | None = None
    """Values from weights or constants made before the step: the indices along the leading
    dimension that hold non-finite values (the samples, when that dimension is the batch)."""
    read_arg: str | None = None
    """The first op that read a tensor from before the step: the argument it got it as."""
    read_rows: list[int] | None = None
    """An index op (embedding, index, index_select) that read a non-finite table from before
    the step: the table's non-finite rows it read."""

    def chain(self) -> list[Hop]:
        """The hops from the root to this value, root first."""
        out: list[Hop] = []
        hop: Hop | None = self
        while hop is not None and len(out) < 10_000:
            out.append(hop)
            hop = hop.parent
        return out[::-1]


def hop_for(origin: Origin, tensor: Tensor | None, site: OpSite | None) -> Hop:
    shape = list(tensor.shape) if tensor is not None else []
    dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else "?"
    return Hop(origin, site, origin.value, shape, dtype, roots=(origin,))


def union(parents: list[Hop], limit: int = 16) -> tuple[Origin, ...]:
    """Every root of ``parents``, each once, in the order met."""
    seen: dict[int, Origin] = {}
    for parent in parents:
        for root in parent.roots:
            seen.setdefault(id(root), root)
    return tuple(list(seen.values())[:limit])
