"""One op call as the non-finite tracer (``localize.NonFiniteTracer``) judges it: its
operands, the tensors it writes in place (``mutated_args``, from the op's schema) and their
state and copies from before it ran, so an in-place op is described by the operands it was
called with, not the values it left."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_flatten

from trainguard.replay import masks
from trainguard.replay.values import float_tensors

MAX_COPY = 1 << 24
"""In-place ops on tensors up to this many elements are described with copies of their
operands taken before they ran (larger ones with the values they left)."""


FRESH = frozenset(("aten.lift_fresh", "aten.lift_fresh_copy"))
"""A tensor literal (``torch.tensor([1.0, -inf])``) entering the trace: made in the step."""


def mutated_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
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


@dataclass
class OpCall:
    """One op call as the tracer judges it."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    before: dict[int, tuple[bool, bool]] = field(default_factory=dict)
    """Tensors the op writes: ``(non-finite, NaN)`` before it ran, by ``id``."""
    copies: dict[int, Tensor] = field(default_factory=dict)
    """... and copies of them, taken before it ran (up to ``MAX_COPY`` elements)."""

    @property
    def operands(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return self.args, self.kwargs

    @property
    def flat(self) -> list[Any]:
        flat, _ = tree_flatten((self.args, self.kwargs))
        return flat

    @property
    def name(self) -> str:
        return masks.op_name(self.func)
