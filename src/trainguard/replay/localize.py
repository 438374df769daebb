"""Find where a step first turns non-finite: the root op, the path, the module, the line.

``NonFiniteTracer`` is a ``TorchDispatchMode``: it sees every aten op of the forward pass, of
the loss and of the backward pass, below autograd. After each op it checks the floating-point
outputs. An op is a *root* when it makes a non-finite value from finite inputs (the op that
first overflowed or divided by zero). An op that turns a root's ±inf into NaN (``0 * -inf``
after ``log(0)``) is that root's *NaN-maker*, not a root of its own. A mask value written
on purpose (``masked_fill(mask, -inf)``, ``where(mask, x, -1e9)``, ``full(..., finfo.min)``)
is no root, nor is the overflow of such a value (``finfo.min + finfo.min``): they are
``constant`` origins (masks.py). The root is the reduction (softmax, logsumexp, max, sum...)
over a row that the mask covers entirely, with that row (:class:`masks.MaskedRow`); another
op that makes NaN from deliberate values only is a root too. Every non-finite output is
tagged with a :class:`Hop` (its op, shape, dtype, the value it came from), so the roots and
the path of the *loss* are known even when earlier, harmless non-finite values were masked.

Where an op ran comes from ``sites`` (module stack, user's line). Backward ops are traced to
the forward op they came from: while the forward runs, every op's output is mapped (through
its ``grad_fn``'s sequence number) to that op's site; during the backward,
``torch._C._current_autograd_node()`` names the node being executed, and its sequence number
gives the forward op, module and line.
"""

from __future__ import annotations

import logging
import math
import sys
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from trainguard.replay import masks
from trainguard.replay.masks import MaskedRow
from trainguard.replay.sites import ModuleStack, OpSite, user_frame
from trainguard.replay.values import (
    all_finite,
    first_nonfinite,
    float_tensors,
    has_nan,
    operand_at,
    value_name,
)

logger = logging.getLogger(__name__)


@dataclass
class Origin:
    """Where a non-finite value came from."""

    kind: str
    """``op`` (made by an op), ``constant`` (an op with a non-finite constant argument),
    ``input`` (in the batch), ``parameter`` (in the weights or buffers) or ``untracked``."""
    value: str
    """``nan``, ``inf`` or ``-inf``: the first non-finite value."""
    site: OpSite | None = None
    label: str | None = None
    """Inputs and parameters: what holds it (``batch['x']``, ``encoder.fc.weight``)."""
    detail: str | None = None
    """E.g. ``aten.div(0.0, 0.0) = nan at [3] (1 of 4 elements)``."""
    inputs_finite: bool = True
    """Every input of the op was finite (False: it held ±inf but no NaN)."""
    masked_row: MaskedRow | None = None
    """A reduction over a row that a mask covered entirely: that row."""


def _mutated_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out: list[Tensor] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out.extend(float_tensors(value))
    return out


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

    def chain(self) -> list[Hop]:
        """The hops from the root to this value, root first."""
        out: list[Hop] = []
        hop: Hop | None = self
        while hop is not None and len(out) < 10_000:
            out.append(hop)
            hop = hop.parent
        return out[::-1]


def _hop_for(origin: Origin, tensor: Tensor | None, site: OpSite | None) -> Hop:
    shape = list(tensor.shape) if tensor is not None else []
    dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else "?"
    return Hop(origin, site, origin.value, shape, dtype, roots=(origin,))


def _union(parents: list[Hop], limit: int = 16) -> tuple[Origin, ...]:
    seen: dict[int, Origin] = {}
    for parent in parents:
        for root in parent.roots:
            seen.setdefault(id(root), root)
    return tuple(list(seen.values())[:limit])


_NOT_ROOTS = ("constant", "untracked")
"""Roots that are no cause of their own: ``masked_fill(mask, -inf)`` is deliberate."""


class NonFiniteTracer(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the origins of non-finite values while a step runs (see the module docstring).

    Set ``phase`` to ``"backward"`` before calling ``backward()``, or pass
    ``auto_phase=True`` (live tracing): an op run by the autograd engine is a backward op.
    """

    def __init__(self, modules: ModuleStack, max_origins: int = 64, auto_phase: bool = False):
        super().__init__()  # type: ignore[no-untyped-call]
        self.modules = modules
        self.origins: list[Origin] = []
        """The roots, in the order they were made."""
        self.nan_makers: list[Origin] = []
        self.root_hops: dict[int, Hop] = {}
        self.latest: dict[int, Hop] = {}
        """Per root (by id): the last hop that carried its values."""
        self.auto_phase = auto_phase
        self.last_forward: weakref.ref[Tensor] | None = None
        """The output of the last forward op before the backward began (the loss)."""
        self._recent: deque[weakref.ref[Tensor]] = deque(maxlen=8)
        self._phase = "forward"
        self._max = max_origins
        self._taint: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._masks: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        """Finite tensors that hold huge mask values (``finfo.min``), to the write's site."""
        self._pending: list[tuple[weakref.ref[Tensor], OpSite]] = []
        self._node_sites: dict[int, OpSite] = {}
        self.errors = 0

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._flush()
        if value == "backward" and self._phase != "backward":
            self.last_forward = self.last_output
        self._phase = value

    @property
    def last_output(self) -> weakref.ref[Tensor] | None:
        """The output of the last forward op traced that autograd records (``backward()``'s
        own ``ones_like`` is not one)."""
        for ref in reversed(self._recent):
            tensor = ref()
            if tensor is not None and tensor.grad_fn is not None:
                return ref
        return self._recent[-1] if self._recent else None

    def seed(self, tensor: Tensor, origin: Origin) -> None:
        """Mark a tensor that is non-finite before the step (batch input, weight)."""
        hop = _hop_for(origin, tensor, None)
        self.root_hops[id(origin)] = hop
        self._taint[tensor] = hop

    def hop_of(self, tensor: Tensor) -> Hop | None:
        hop: Hop | None = self._taint.get(tensor)  # type: ignore[no-untyped-call]
        return hop

    def origin_of(self, tensor: Tensor) -> Origin | None:
        hop = self.hop_of(tensor)
        return hop.origin if hop is not None else None

    def first(self, phase: str) -> Origin | None:
        return next((o for o in self.origins if o.site and o.site.phase == phase), None)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.auto_phase:
            running = torch._C._current_autograd_node() is not None
            if running != (self._phase == "backward"):
                self.phase = "backward" if running else "forward"
        self._flush()
        before: dict[int, tuple[bool, bool]] = {}
        for t in _mutated_args(func, args, kwargs):
            finite = all_finite(t)
            before[id(t)] = (not finite, not finite and has_nan(t))
        out = func(*args, **kwargs)
        try:
            self._after(func, args, kwargs, out, before)
        except Exception as exc:  # the tracer must never break the replay
            self.errors += 1
            logger.debug("trainguard: tracer skipped %s: %s", func, exc)
        return out

    # -- internals -----------------------------------------------------------------------

    def _flush(self) -> None:
        """Map the last forward ops' autograd nodes to their sites (grad_fn is set by now)."""
        for ref, site in self._pending:
            tensor = ref()
            node = tensor.grad_fn if tensor is not None else None
            if node is not None:
                self._node_sites[node._sequence_nr()] = site
        self._pending = []

    def _site(self, func: Any) -> OpSite:
        packet = getattr(func, "overloadpacket", func)
        op = f"aten.{getattr(packet, '__name__', str(packet))}"
        source, code = user_frame(sys._getframe(1))
        if self._phase == "backward":
            node = torch._C._current_autograd_node()
            forward = self._node_sites.get(node._sequence_nr()) if node is not None else None
            module = forward.module if forward else None
            in_model = forward.in_model if forward else False
            custom = isinstance(node, torch.autograd.function.BackwardCFunction)
            if forward is not None and not (custom and source):
                source, code = forward.source, forward.code  # a custom backward: its own line
            elif forward is None and not custom:  # the engine's own op (AccumulateGrad's
                source, code = None, None  # detach): the frame is only backward()'s caller
            grad_fn = node.name() if node is not None else None
            return OpSite(
                op, str(func), "backward", module, in_model, source, code, grad_fn, forward
            )
        module, in_model = self.modules.current()
        return OpSite(op, str(func), "forward", module, in_model, source, code)

    def _after(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        before: dict[int, tuple[bool, bool]],
    ) -> None:
        outs = float_tensors(out)
        site: OpSite | None = None
        if self._phase == "forward" and outs:
            site = self._site(func)
            self._pending.extend((weakref.ref(t), site) for t in outs)
            self._recent.extend(weakref.ref(t) for t in outs)
        bad = [t for t in outs if not all_finite(t)]
        if not bad:
            for t in outs:  # an in-place op may have made a tainted tensor finite again
                self._taint.pop(t, None)  # type: ignore[no-untyped-call]
            self._mark_masks(func, (args, kwargs), outs, site)
            return
        hop = self._hop(func, (args, kwargs), bad, before, site)
        for t in bad:
            self._taint[t] = hop

    def _mark_masks(
        self, func: Any, operands: Any, outs: list[Tensor], site: OpSite | None
    ) -> None:
        """Remember finite outputs that hold mask values: written by a mask op with a huge
        constant, or computed from such a tensor and still holding huge values."""
        if masks.writes_masks(func):  # checked first: flattening every op's args costs
            flat, _ = tree_flatten(operands)
            if masks.mask_constant(func, flat) is not None:
                for t in outs:
                    self._masks[t] = site or self._site(func)
                return
        if not len(self._masks):
            return
        source = next((self._masks[t] for t in float_tensors(operands) if t in self._masks), None)
        for t in outs:
            if source is not None and masks.holds_huge(t):
                self._masks[t] = source
            else:
                self._masks.pop(t, None)  # type: ignore[no-untyped-call]

    def _deliberate(self, func: Any, operands: Any, flat: list[Any], bad: list[Tensor]) -> bool:
        """The op's non-finite outputs are mask values: a mask op's infinite or huge
        constant, or an overflow of huge mask values (``finfo.min + finfo.min``)."""
        if masks.mask_constant(func, flat) is not None:
            return True
        if not len(self._masks):
            return False
        marked = [t for t in float_tensors(operands) if t in self._masks]
        return masks.explained_by_masks(bad, marked)

    def _hop(
        self,
        func: Any,
        operands: Any,
        bad: list[Tensor],
        before: dict[int, tuple[bool, bool]],
        site: OpSite | None,
    ) -> Hop:
        """The hop of this op's non-finite outputs: a new root, a NaN-maker or a carrier."""
        out_nan = any(has_nan(t) for t in bad)
        nan_in, nonfinite_in, parents, carrier = self._inputs(operands, before, out_nan)
        flat, _ = tree_flatten(operands)
        constant = any(isinstance(a, float) and not math.isfinite(a) for a in flat)
        if not nonfinite_in and not constant:
            constant = self._deliberate(func, operands, flat, bad)
        makes_nan = out_nan and not nan_in and not constant
        causes = [r for r in _union(parents) if r.kind not in _NOT_ROOTS]
        if nonfinite_in and not causes:
            args, kwargs = operands
            row = masks.fully_masked_row(func, args, kwargs)
            if row is not None:
                return self._masked_row_root(func, flat, bad, row, site, carrier)
        if carrier is not None and (not makes_nan or causes):
            site = site or self._site(func)
            index, value, count = first_nonfinite(bad[0], nan_first=out_nan)
            nan_maker = carrier.nan_maker
            if makes_nan:
                detail = self._detail(func, flat, bad[0], index, value, count)
                nan_maker = Origin("op", "nan", site, detail=detail, inputs_finite=False)
                self.nan_makers.append(nan_maker)
            hop = _hop_for(carrier.origin, bad[0], site)
            hop.value, hop.parent, hop.roots = value_name(value), carrier, _union(parents)
            hop.nan_maker = nan_maker
            self.latest[id(carrier.origin)] = hop
            return hop
        new = makes_nan or not (nonfinite_in or constant)
        kind = "op" if new else ("constant" if constant else "untracked")
        site = site or self._site(func)
        index, value, count = first_nonfinite(bad[0], nan_first=out_nan)
        origin = Origin(
            kind,
            value_name(value),
            site=site,
            detail=self._detail(func, flat, bad[0], index, value, count),
            inputs_finite=not nonfinite_in,
        )
        if len(self.origins) < self._max:
            self.origins.append(origin)
        hop = _hop_for(origin, bad[0], site)
        self.root_hops[id(origin)] = hop
        return hop

    def _masked_row_root(
        self,
        func: Any,
        flat: list[Any],
        bad: list[Tensor],
        row: MaskedRow,
        site: OpSite | None,
        carrier: Hop | None,
    ) -> Hop:
        """A reduction over a fully masked row: the root (with the row), not the mask."""
        site = site or self._site(func)
        out_nan = any(has_nan(t) for t in bad)
        index, value, count = first_nonfinite(bad[0], nan_first=out_nan)
        made = self._detail(func, flat, bad[0], index, value, count)
        mask_site = carrier.origin.site if carrier is not None else None
        written = f", written by {mask_site.op}" if mask_site is not None else ""
        if mask_site is not None and mask_site.source:
            written += f" ({mask_site.source})"
        detail = f"{made}: {row.text()}{written}"
        origin = Origin(
            "op", value_name(value), site, detail=detail, inputs_finite=False, masked_row=row
        )
        if len(self.origins) < self._max:
            self.origins.append(origin)
        hop = _hop_for(origin, bad[0], site)
        self.root_hops[id(origin)] = hop
        return hop

    def _inputs(
        self, operands: Any, before: dict[int, tuple[bool, bool]], out_nan: bool
    ) -> tuple[bool, bool, list[Hop], Hop | None]:
        """``(nan_in, nonfinite_in, parents, carrier)`` of an op's inputs: the hops of its
        non-finite inputs, and the one its output continues (one from a real cause rather
        than a deliberate -inf, and a NaN one for a NaN output)."""
        nan_in, nonfinite_in = False, False
        parents: list[Hop] = []
        carrier: Hop | None = None
        best = (False, False)
        for t in float_tensors(operands):
            if id(t) in before:
                t_nonfinite, t_nan = before[id(t)]
            else:
                t_nonfinite = not all_finite(t)
                t_nan = t_nonfinite and has_nan(t)
            nan_in |= t_nan
            nonfinite_in |= t_nonfinite
            known = self.hop_of(t) if t_nonfinite else None
            if known is not None:
                parents.append(known)
                rank = (known.origin.kind not in _NOT_ROOTS, out_nan and t_nan)
                if carrier is None or rank > best:  # a real cause first, then a NaN one
                    carrier, best = known, rank
        return nan_in, nonfinite_in, parents, carrier

    def _detail(
        self,
        func: Any,
        flat_args: list[Any],
        out: Tensor,
        index: list[int],
        value: float,
        count: int,
    ) -> str:
        where = f"at {index}, {count} of {out.numel()} elements" if index else "(a scalar)"
        op = f"aten.{getattr(getattr(func, 'overloadpacket', func), '__name__', func)}"
        if torch.Tag.pointwise not in getattr(func, "tags", ()):
            return f"{op} gave {value_name(value)} {where}"
        operands = [operand_at(a, out.shape, index) for a in flat_args]
        shown = [o for o in operands if o is not None]
        return f"{op}({', '.join(shown)}) = {value_name(value)} {where}"
