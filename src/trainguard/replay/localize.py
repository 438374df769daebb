"""Find where a step first turns non-finite: the aten op, the module it ran in, the user's line.

``NonFiniteTracer`` is a ``TorchDispatchMode``: it sees every aten op of the forward pass, of
the loss and of the backward pass, below autograd. After each op it checks the floating-point
outputs. An op is an *origin* when its output holds NaN while no input holds NaN, or holds
±Inf while every input is finite (so ``softmax`` of a fully masked row, whose inputs hold
-inf but no NaN, is an origin, while ``masked_fill(mask, -inf)`` is not: its non-finite value
is a constant argument). Every non-finite output is tagged with the origin it came from, so
the origin of the *loss* is known even when earlier, harmless non-finite values were masked.

Module paths come from global forward pre/post hooks (a stack of running modules, named by
``model.named_modules()``). The user's ``file:line`` is the innermost Python frame outside
torch, the standard library and trainguard's own machinery.

Backward ops are traced to the forward op they came from: while the forward runs, every op's
output is mapped (through its ``grad_fn``'s sequence number) to that op's site; during the
backward, ``torch._C._current_autograd_node()`` names the node being executed, and its
sequence number gives the forward op, module and line.
"""

from __future__ import annotations

import linecache
import logging
import math
import os
import sys
import sysconfig
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

logger = logging.getLogger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_SITE_DIRS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})
_OWN_DIR = os.path.dirname(__file__) + os.sep
_OWN_USER_FILES = ("demo.py",)  # trainguard files that hold user-level model code


@dataclass
class OpSite:
    """Where an op ran."""

    op: str
    """The op, e.g. ``aten.div``."""
    overload: str
    """The exact overload, e.g. ``aten.div.Tensor``."""
    phase: str
    """``forward`` (forward pass and loss) or ``backward``."""
    module: str | None
    """The module path (``encoder.layers.3.attn``), or None outside every module."""
    in_model: bool
    """The module belongs to the replayed model (False: outside it, e.g. in loss_fn)."""
    source: str | None
    """The user's ``file:line``."""
    code: str | None
    """That line's text."""
    grad_fn: str | None = None
    """Backward ops: the autograd node that ran them (e.g. ``DivBackward0``)."""
    forward: OpSite | None = None
    """Backward ops: the forward op whose gradient they compute."""


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


def _float_tensors(tree: Any) -> list[Tensor]:
    flat, _ = tree_flatten(tree)
    return [
        t
        for t in flat
        if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel()
    ]


def _finite(t: Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _has_nan(t: Tensor) -> bool:
    return bool(torch.isnan(t).any())


def first_nonfinite(t: Tensor) -> tuple[list[int], float, int]:
    """Index and value of the first non-finite element (complex: its modulus), and the count."""
    data = t.detach()
    data = data.abs() if data.is_complex() else data
    mask = ~torch.isfinite(data)
    where = mask.nonzero()
    index = [int(i) for i in where[0].tolist()] if where.numel() else []
    return index, float(data[tuple(index)].item()), int(mask.sum())


def _value_name(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _format_number(value: Any) -> str:
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else _value_name(value)
    return repr(value)


class ModuleStack:
    """The modules running now, from global forward hooks, named by the model."""

    def __init__(self, model: nn.Module) -> None:
        self._names = {id(m): name for name, m in model.named_modules()}
        self._root = type(model).__name__
        self._stack: list[nn.Module] = []
        self._handles: list[Any] = []

    def __enter__(self) -> ModuleStack:
        from torch.nn.modules import module as nn_module

        self._handles = [
            nn_module.register_module_forward_pre_hook(self._push),
            nn_module.register_module_forward_hook(self._pop, always_call=True),
        ]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack = []

    def _push(self, module: nn.Module, args: Any) -> None:
        self._stack.append(module)

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        while self._stack:
            if self._stack.pop() is module:
                break

    def current(self) -> tuple[str | None, bool]:
        """``(path, in_model)`` of the innermost running module; ``(None, False)`` outside."""
        for module in reversed(self._stack):
            name = self._names.get(id(module))
            if name is not None:
                return (name or self._root), True
        if self._stack:
            return type(self._stack[-1]).__name__, False
        return None, False

    def path_of_parameter(self, name: str) -> str:
        owner = name.rpartition(".")[0]
        return owner or self._root


def user_frame(start: FrameType | None) -> tuple[str | None, str | None]:
    """``(file:line, code)`` of the innermost frame outside torch/stdlib/trainguard."""
    frame = start
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_internal(filename):
            code = linecache.getline(filename, frame.f_lineno).strip() or None
            return f"{_short_path(filename)}:{frame.f_lineno}", code
        frame = frame.f_back
    return None, None


def _is_internal(filename: str) -> bool:
    if filename.startswith("<"):
        return filename not in ("<stdin>", "<string>")  # <frozen ...> is internal
    if filename.startswith(_TORCH_DIR):
        return True
    if filename.startswith(_STDLIB_DIR) and not filename.startswith(_SITE_DIRS):
        return True
    return filename.startswith(_OWN_DIR) and os.path.basename(filename) not in _OWN_USER_FILES


def _short_path(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return rel if not rel.startswith("..") else filename


def _mutated_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out: list[Tensor] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out.extend(_float_tensors(value))
    return out


class NonFiniteTracer(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the origins of non-finite values while a step runs (see the module docstring).

    Set ``phase`` to ``"backward"`` before calling ``backward()``.
    """

    def __init__(self, modules: ModuleStack, max_origins: int = 64) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.modules = modules
        self.origins: list[Origin] = []
        self._phase = "forward"
        self._max = max_origins
        self._taint: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._pending: list[tuple[weakref.ref[Tensor], OpSite]] = []
        self._node_sites: dict[int, OpSite] = {}
        self.errors = 0

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._flush()
        self._phase = value

    def seed(self, tensor: Tensor, origin: Origin) -> None:
        """Mark a tensor that is non-finite before the step (batch input, weight)."""
        self._taint[tensor] = origin

    def origin_of(self, tensor: Tensor) -> Origin | None:
        origin: Origin | None = self._taint.get(tensor)  # type: ignore[no-untyped-call]
        return origin

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
        self._flush()
        before: dict[int, tuple[bool, bool]] = {}
        for t in _mutated_args(func, args, kwargs):
            finite = _finite(t)
            before[id(t)] = (not finite, not finite and _has_nan(t))
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
            if forward is not None:
                source, code = forward.source, forward.code
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
        outs = _float_tensors(out)
        site: OpSite | None = None
        if self._phase == "forward" and outs:
            site = self._site(func)
            self._pending.extend((weakref.ref(t), site) for t in outs)
        bad = [t for t in outs if not _finite(t)]
        if not bad:
            for t in outs:  # an in-place op may have made a tainted tensor finite again
                self._taint.pop(t, None)  # type: ignore[no-untyped-call]
            return
        origin = self._origin(func, args, kwargs, bad, before, site)
        for t in bad:
            self._taint[t] = origin

    def _origin(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        bad: list[Tensor],
        before: dict[int, tuple[bool, bool]],
        site: OpSite | None,
    ) -> Origin:
        out_nan = any(_has_nan(t) for t in bad)
        nan_in, nonfinite_in = False, False
        carrier: Origin | None = None
        for t in _float_tensors((args, kwargs)):
            if id(t) in before:
                t_nonfinite, t_nan = before[id(t)]
            else:
                t_nonfinite = not _finite(t)
                t_nan = t_nonfinite and _has_nan(t)
            nan_in |= t_nan
            nonfinite_in |= t_nonfinite
            known = self._taint.get(t) if t_nonfinite else None  # type: ignore[no-untyped-call]
            if known is not None and (carrier is None or (out_nan and t_nan)):
                carrier = known
        flat, _ = tree_flatten((args, kwargs))
        constant = any(isinstance(a, float) and not math.isfinite(a) for a in flat)
        new = (out_nan and not nan_in and not constant) or not (nonfinite_in or constant)
        if not new and carrier is not None:
            return carrier
        site = site or self._site(func)
        index, value, count = first_nonfinite(bad[0])
        kind = "op" if new else ("constant" if constant else "untracked")
        origin = Origin(
            kind,
            _value_name(value),
            site=site,
            detail=self._detail(func, flat, bad[0], index, value, count),
            inputs_finite=not nonfinite_in,
        )
        if len(self.origins) < self._max:
            self.origins.append(origin)
        return origin

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
            return f"{op} gave {_value_name(value)} {where}"
        operands = [_operand_at(a, out.shape, index) for a in flat_args]
        shown = [o for o in operands if o is not None]
        return f"{op}({', '.join(shown)}) = {_value_name(value)} {where}"


def _operand_at(arg: Any, shape: torch.Size, index: list[int]) -> str | None:
    if isinstance(arg, Tensor):
        try:
            item = torch.broadcast_to(arg.detach(), shape)[tuple(index)].item()
        except (RuntimeError, IndexError):
            return None
        return _format_number(float(item) if isinstance(item, (int, float)) else item)
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return _format_number(arg)
    return None


def seed_inputs(
    tracer: NonFiniteTracer, batch: Any, leaves: Callable[[Any], Any], size: int | None
) -> list[Origin]:
    """Tag the batch's non-finite tensors as ``input`` origins; returns them."""
    found: list[Origin] = []
    for path, leaf in leaves(batch):
        if not isinstance(leaf, Tensor) or not (leaf.is_floating_point() or leaf.is_complex()):
            continue
        if not leaf.numel() or _finite(leaf):
            continue
        index, value, count = first_nonfinite(leaf)
        label = f"batch{path}"
        sample = f", sample {index[0]}" if size and leaf.dim() and leaf.shape[0] == size else ""
        detail = (
            f"{label} holds {_plural(count, 'non-finite value')} (first: {_value_name(value)} "
            f"at {index}{sample})"
        )
        origin = Origin(
            "input", _value_name(value), label=label, detail=detail, inputs_finite=False
        )
        tracer.seed(leaf, origin)
        found.append(origin)
    return found


def seed_parameters(tracer: NonFiniteTracer, model: nn.Module) -> list[Origin]:
    """Tag non-finite weights and buffers as ``parameter`` origins; returns them."""
    found: list[Origin] = []
    named = list(model.named_parameters()) + list(model.named_buffers())
    for name, tensor in named:
        if not (tensor.is_floating_point() or tensor.is_complex()) or _finite(tensor):
            continue
        _, value, count = first_nonfinite(tensor)
        detail = f"{name} holds {_plural(count, 'non-finite value')} before the step"
        origin = Origin("parameter", _value_name(value), label=name, detail=detail)
        tracer.seed(tensor, origin)
        found.append(origin)
    return found
