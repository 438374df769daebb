"""Find where a step first turns non-finite: the root op, the path, the module, the line.

``NonFiniteTracer`` is a ``TorchDispatchMode``: it sees every aten op of the forward pass, of
the loss and of the backward pass, below autograd. After each op it checks the floating-point
outputs. An op is a *root* when it makes a non-finite value from finite inputs (the op that
first overflowed or divided by zero). An op that turns a root's ±inf into NaN (``0 * -inf``
after ``log(0)``) is that root's *NaN-maker*, not a root of its own. A mask value written
on purpose (``masked_fill(mask, -inf)``, ``where(mask, x, -1e9)``, ``full(..., finfo.min)``)
is no root, nor is the overflow of such a value (``finfo.min + finfo.min``): they are
``constant`` origins (masks.py). The root is the reduction (softmax, logsumexp, max, sum...)
over a row that the mask covers entirely, with that row (:class:`masks.MaskedRow`), or the op
that reads a masked position in a row the mask covers only partly (the loss at a target the
mask forbids: :class:`masked_reads.MaskedRead`). Every non-finite output is tagged with a
:class:`Hop` (its op, shape, dtype, the value it came from), so the roots and the path of the
*loss* are known even when earlier, harmless non-finite values were masked.

Values that were non-finite before the step are tagged before the ops run (seeds.py: the
batch, the weights, the buffers of modules outside the model); a non-finite input that no
traced op made and nothing tagged was made before the step too (a tensor the loop made and
the loss function keeps): it is tagged at its first read (external.py). The hops that carry
such values note which leading indices (samples) hold them, and an index op reading a table's
non-finite rows notes the rows (rows.py). In-place ops are described with their operands as
they were before the op ran.

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
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from trainguard.replay import masks
from trainguard.replay.external import argument_name, lazy_origin
from trainguard.replay.hops import NOT_ROOTS, Hop, Origin, hop_for, union
from trainguard.replay.masked_reads import keeps_mask, masked_read
from trainguard.replay.masks import MaskedRow
from trainguard.replay.op_calls import FRESH, MAX_COPY, OpCall, mutated_args
from trainguard.replay.rows import lead_rows, rows_read
from trainguard.replay.sites import ModuleStack, OpSite, user_frame
from trainguard.replay.values import (
    all_finite,
    first_nonfinite,
    float_tensors,
    has_nan,
    op_detail,
    value_name,
)

logger = logging.getLogger(__name__)

__all__ = ["Hop", "NonFiniteTracer", "Origin"]


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
        self._owned: tuple[int, set[int]] = (-1, set())
        """The ids of the models' weights and buffers (for how many models)."""
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
        hop = hop_for(origin, tensor, None)
        self.root_hops[id(origin)] = hop
        self._taint[tensor] = hop

    def tagged(self, tensor: Tensor) -> bool:
        return tensor in self._taint

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
        call = OpCall(func, args, kwargs or {})
        if self.auto_phase:
            running = torch._C._current_autograd_node() is not None
            if running != (self._phase == "backward"):
                self.phase = "backward" if running else "forward"
        self._flush()
        for t in mutated_args(func, args, call.kwargs):
            finite = all_finite(t)
            call.before[id(t)] = (not finite, not finite and has_nan(t))
            if t.numel() <= MAX_COPY:
                call.copies[id(t)] = t.detach().clone()
        out = func(*args, **call.kwargs)
        try:
            self._after(call, out)
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
        op = masks.op_name(func)
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

    def _after(self, call: OpCall, out: Any) -> None:
        outs = float_tensors(out)
        site: OpSite | None = None
        if self._phase == "forward" and outs:
            site = self._site(call.func)
            self._pending.extend((weakref.ref(t), site) for t in outs)
            self._recent.extend(weakref.ref(t) for t in outs)
        bad = [t for t in outs if not all_finite(t)]
        if not bad:
            for t in outs:  # an in-place op may have made a tainted tensor finite again
                self._taint.pop(t, None)  # type: ignore[no-untyped-call]
            self._mark_masks(call.func, call.operands, outs, site)
            return
        hop = self._hop(call, bad, site)
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

    def _deliberate(self, call: OpCall, flat: list[Any], bad: list[Tensor]) -> bool:
        """The op's non-finite outputs are mask values: a mask op's infinite or huge
        constant, or an overflow of huge mask values (``finfo.min + finfo.min``)."""
        if masks.mask_constant(call.func, flat) is not None:
            return True
        if not len(self._masks):
            return False
        marked = [t for t in float_tensors(call.operands) if t in self._masks]
        return masks.explained_by_masks(bad, marked)

    def _hop(self, call: OpCall, bad: list[Tensor], site: OpSite | None) -> Hop:
        """The hop of this op's non-finite outputs: a new root, a NaN-maker or a carrier."""
        out_nan = any(has_nan(t) for t in bad)
        nan_in, nonfinite_in, parents, carrier = self._inputs(call, out_nan)
        flat = call.flat
        constant = any(isinstance(a, float) and not math.isfinite(a) for a in flat)
        if not nonfinite_in and not constant:
            constant = self._deliberate(call, flat, bad)
        makes_nan = out_nan and not nan_in and not constant
        causes = [r for r in union(parents) if r.kind not in NOT_ROOTS]
        if nonfinite_in and not causes:
            row = masks.fully_masked_row(call.func, call.args, call.kwargs)
            if row is not None:
                return self._masked_row_root(call, flat, bad, row, site, carrier)
            masked = [t for t in float_tensors(call.operands) if self.tagged(t)]
            if (
                carrier is not None
                and _mask_values(carrier)
                and (makes_nan or not keeps_mask(call.func, bad, masked))
            ):
                return self._masked_read_root(call, flat, bad, site, carrier, masked)
        if carrier is not None and (not makes_nan or causes):
            return self._carry(call, flat, bad, site, carrier, parents, makes_nan)
        new = makes_nan or not (nonfinite_in or constant)
        kind = "op" if new else ("constant" if constant else "untracked")
        site = site or self._site(call.func)
        found = first_nonfinite(bad[0], nan_first=out_nan)
        origin = Origin(
            kind,
            value_name(found[1]),
            site=site,
            detail=op_detail(call.func, flat, bad[0], found, call.copies),
            inputs_finite=not nonfinite_in,
        )
        return self._root(origin, bad[0], site)

    def _root(self, origin: Origin, tensor: Tensor, site: OpSite | None) -> Hop:
        if len(self.origins) < self._max:
            self.origins.append(origin)
        hop = hop_for(origin, tensor, site)
        hop.lead = lead_rows(tensor)  # the samples the root's values sit in (batch-first)
        self.root_hops[id(origin)] = hop
        return hop

    def _carry(
        self,
        call: OpCall,
        flat: list[Any],
        bad: list[Tensor],
        site: OpSite | None,
        carrier: Hop,
        parents: list[Hop],
        makes_nan: bool,
    ) -> Hop:
        """This op carries ``carrier``'s values on (a NaN-maker when it made NaN of them)."""
        site = site or self._site(call.func)
        out_nan = any(has_nan(t) for t in bad)
        found = first_nonfinite(bad[0], nan_first=out_nan)
        nan_maker = carrier.nan_maker
        if makes_nan:
            detail = op_detail(call.func, flat, bad[0], found, call.copies)
            nan_maker = Origin("op", "nan", site, detail=detail, inputs_finite=False)
            self.nan_makers.append(nan_maker)
        hop = hop_for(carrier.origin, bad[0], site)
        hop.value, hop.parent, hop.roots = value_name(found[1]), carrier, union(parents)
        hop.nan_maker = nan_maker
        if carrier.origin.kind in ("parameter", "external"):
            self._note_read(call, bad[0], carrier, hop)
        self.latest[id(carrier.origin)] = hop
        return hop

    def _note_read(self, call: OpCall, out: Tensor, carrier: Hop, hop: Hop) -> None:
        """Values from before the step: the samples that hold them, and what the first op
        that read the tensor itself read of it (the argument, the table's rows)."""
        hop.lead = lead_rows(out)
        if carrier.site is not None:
            return
        table = next((t for t in float_tensors(call.operands) if self.hop_of(t) is carrier), None)
        if table is None:
            return
        hop.read_arg = argument_name(call.func, call.args, call.kwargs, table)
        if carrier.origin.kind == "parameter":
            hop.read_rows = rows_read(call.func, call.args, table)

    def _masked_row_root(
        self,
        call: OpCall,
        flat: list[Any],
        bad: list[Tensor],
        row: MaskedRow,
        site: OpSite | None,
        carrier: Hop | None,
    ) -> Hop:
        """A reduction over a fully masked row: the root (with the row), not the mask."""
        site = site or self._site(call.func)
        out_nan = any(has_nan(t) for t in bad)
        found = first_nonfinite(bad[0], nan_first=out_nan)
        made = op_detail(call.func, flat, bad[0], found, call.copies)
        detail = f"{made}: {row.text()}{_written_by(carrier)}"
        origin = Origin(
            "op", value_name(found[1]), site, detail=detail, inputs_finite=False, masked_row=row
        )
        return self._root(origin, bad[0], site)

    def _masked_read_root(
        self,
        call: OpCall,
        flat: list[Any],
        bad: list[Tensor],
        site: OpSite | None,
        carrier: Hop,
        masked: list[Tensor],
    ) -> Hop:
        """An op that turned mask values into a real inf or NaN (masked_reads.py): the root,
        with what it read, not the mask."""
        site = site or self._site(call.func)
        out_nan = any(has_nan(t) for t in bad)
        found = first_nonfinite(bad[0], nan_first=out_nan)
        made = op_detail(call.func, flat, bad[0], found, call.copies)
        source = next((t for t in masked if self.hop_of(t) is carrier), masked[0])
        read = masked_read(call.func, call.args, call.kwargs, source)
        detail = f"{made}: {read.text()}{_written_by(carrier)}"
        origin = Origin(
            "op", value_name(found[1]), site, detail=detail, inputs_finite=False, masked_read=read
        )
        return self._root(origin, bad[0], site)

    def _inputs(self, call: OpCall, out_nan: bool) -> tuple[bool, bool, list[Hop], Hop | None]:
        """``(nan_in, nonfinite_in, parents, carrier)`` of an op's inputs: the hops of its
        non-finite inputs, and the one its output continues (one from a real cause rather
        than a deliberate -inf, and a NaN one for a NaN output)."""
        nan_in, nonfinite_in = False, False
        parents: list[Hop] = []
        carrier: Hop | None = None
        best = (False, False)
        for t in float_tensors(call.operands):
            if id(t) in call.before:
                t_nonfinite, t_nan = call.before[id(t)]
            else:
                t_nonfinite = not all_finite(t)
                t_nan = t_nonfinite and has_nan(t)
            nan_in |= t_nan
            nonfinite_in |= t_nonfinite
            known = self.hop_of(t) if t_nonfinite else None
            if known is None and t_nonfinite and call.name not in FRESH:
                known = self._made_before(call, t)
            if known is not None:
                parents.append(known)
                rank = (known.origin.kind not in NOT_ROOTS, out_nan and t_nan)
                if carrier is None or rank > best:  # a real cause first, then a NaN one
                    carrier, best = known, rank
        return nan_in, nonfinite_in, parents, carrier

    def _made_before(self, call: OpCall, tensor: Tensor) -> Hop | None:
        """A non-finite input that nothing tagged and no traced op made: made before the
        step (external.py); tagged now, at its first read. Not in the backward pass, whose
        inputs the forward made, nor a model's weight or buffer (seeded when non-finite
        before the step; else an op wrote it in place without saying so in its schema, as
        ``native_batch_norm`` writes the running statistics)."""
        if self._phase != "forward" or id(tensor) in self._model_tensors():
            return None  # a model's buffer written in place by an op (BatchNorm's statistics)
        origin = lazy_origin(call.func, call.args, call.kwargs, tensor)
        self.seed(tensor, origin)
        return self.hop_of(tensor)

    def _model_tensors(self) -> set[int]:
        roots = self.modules.roots
        if self._owned[0] != len(roots):
            owned = {id(t) for m in roots for t in [*m.parameters(), *m.buffers()]}
            self._owned = (len(roots), owned)
        return self._owned[1]


def _mask_values(hop: Hop) -> bool:
    """``hop`` carries mask values: a deliberate constant's, or ±inf no traced op made (a
    literal ``torch.tensor(-inf)``), not a NaN of unknown origin."""
    return hop.origin.kind == "constant" or hop.value in ("inf", "-inf")


def _written_by(carrier: Hop | None) -> str:
    """``, written by aten.masked_fill (model.py:12)``: the mask's writer."""
    mask_site = carrier.origin.site if carrier is not None else None
    if mask_site is None:
        return ""
    written = f", written by {mask_site.op}"
    return written + (f" ({mask_site.source})" if mask_site.source else "")
