"""The optimizer as the diagnosis reads it: its param groups (which parameters, their scalar
hyper-parameters) and its per-parameter state (Adam's moments, SGD's momentum).

A bundle holds ``optimizer.state_dict()``: param groups whose parameters are numbered, and the
state by those numbers. The numbers are matched to the model's parameter names by, in order:
the groups' own ``param_names`` (an optimizer made from ``model.named_parameters()``); the
model's parameter order (an optimizer made from ``model.parameters()``, or from groups that
take the model's parameters in its order), accepted only where every state tensor has its
parameter's shape; each group taking, in the model's order, the next parameters of the shapes
its state holds. Where none fits, the groups are known by their numbers only.

Scalar hyper-parameters are every number in a group (``lr``, ``weight_decay``, ``eps``,
``momentum``, each of ``betas``), a one-element tensor included; ``nan`` / ``inf`` ones are
what the guard's hyper-parameter check stops a step for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from trainguard.capture.optim_state import ZERO_KEY
from trainguard.replay.values import format_number

SKIP = ("params", "param_names")


@dataclass
class Hyper:
    """A scalar hyper-parameter of a param group."""

    group: int
    name: str
    """``lr``, ``weight_decay``, ``betas[1]``..."""
    value: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.value)

    def text(self) -> str:
        return f"{self.name} {format_number(self.value)}"

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "name": self.name, "value": format_number(self.value)}


@dataclass
class ParamGroup:
    index: int
    size: int
    names: list[str] | None
    hypers: list[Hyper] = field(default_factory=list)

    def nonfinite(self) -> list[Hyper]:
        return [h for h in self.hypers if not h.finite]

    def hyper(self, name: str) -> Hyper | None:
        return next((h for h in self.hypers if h.name == name), None)


@dataclass
class OptimizerView:
    groups: list[ParamGroup]
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-parameter state by parameter name (names matched: module docstring)."""
    matched: str = "names"
    """How numbers were matched to names: ``names``, ``order``, ``shapes`` or ``none``."""

    def group_of(self, name: str) -> ParamGroup | None:
        return next((g for g in self.groups if g.names and name in g.names), None)

    def nonfinite(self) -> list[Hyper]:
        return [h for g in self.groups for h in g.nonfinite()]

    def state_of(self, name: str) -> dict[str, Any] | None:
        return self.states.get(name)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
        return float(value.detach().float().item())
    return None


def hypers(index: int, group: dict[str, Any]) -> list[Hyper]:
    """A param group's scalar hyper-parameters (module docstring)."""
    out: list[Hyper] = []
    for key, value in group.items():
        if key in SKIP:
            continue
        if isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                number = _number(item)
                if number is not None:
                    out.append(Hyper(index, f"{key}[{i}]", number))
            continue
        number = _number(value)
        if number is not None:
            out.append(Hyper(index, key, number))
    return out


def _shape(state: dict[str, Any] | None) -> tuple[int, ...] | None:
    """A parameter's shape as its state tensors tell it (None: no state tensor of its
    shape: plain SGD, or a scalar ``step`` only)."""
    for key, value in (state or {}).items():
        if key != "step" and isinstance(value, Tensor) and value.dim() > 0:
            return tuple(value.shape)
    return None


def _strip(name: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def _by_order(
    numbers: list[int],
    shapes: dict[int, tuple[int, ...] | None],
    named: Sequence[tuple[str, tuple[int, ...]]],
) -> dict[int, str] | None:
    if len(numbers) != len(named):
        return None
    out = {}
    for number, (name, shape) in zip(numbers, named, strict=True):
        known = shapes.get(number)
        if known is not None and known != shape:
            return None
        out[number] = name
    return out


def _by_shapes(
    groups: list[list[int]],
    shapes: dict[int, tuple[int, ...] | None],
    named: Sequence[tuple[str, tuple[int, ...]]],
) -> dict[int, str] | None:
    """Each group takes, in the model's order, the next free parameter of each number's
    shape (every number's shape must be known)."""
    if any(shapes.get(n) is None for g in groups for n in g):
        return None
    taken: set[str] = set()
    out: dict[int, str] = {}
    for numbers in groups:
        position = 0
        for number in numbers:
            while position < len(named) and (
                named[position][0] in taken or named[position][1] != shapes[number]
            ):
                position += 1
            if position >= len(named):
                return None
            out[number] = named[position][0]
            taken.add(named[position][0])
    return out


def view_of_state(
    state: dict[str, Any], named: Sequence[tuple[str, tuple[int, ...]]]
) -> OptimizerView | None:
    """The view of a saved ``optimizer.state_dict()``; ``named``: the model's parameters
    (name, shape) in its order. None for a ZeRO shard or a state without param groups."""
    raw_groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(raw_groups, list) or ZERO_KEY in state:
        return None
    per_number = state.get("state") or {}
    numbers = [list(g.get("params") or []) for g in raw_groups]
    names = _match(raw_groups, numbers, per_number, named)
    groups = [
        ParamGroup(i, len(nums), [names[n] for n in nums] if names else None, hypers(i, g))
        for i, (g, nums) in enumerate(zip(raw_groups, numbers, strict=True))
    ]
    states = {names[n]: s for n, s in per_number.items() if names and n in names}
    how = "none" if names is None else _how(raw_groups, numbers, per_number, named)
    return OptimizerView(groups, states, how)


def _match(
    raw_groups: list[dict[str, Any]],
    numbers: list[list[int]],
    per_number: dict[int, Any],
    named: Sequence[tuple[str, tuple[int, ...]]],
) -> dict[int, str] | None:
    if all("param_names" in g for g in raw_groups):
        return {
            n: _strip(str(name))
            for g, nums in zip(raw_groups, numbers, strict=True)
            for n, name in zip(nums, g["param_names"], strict=False)
        }
    shapes = {n: _shape(per_number.get(n)) for nums in numbers for n in nums}
    flat = [n for nums in numbers for n in nums]
    return _by_order(flat, shapes, named) or _by_shapes(numbers, shapes, named)


def _how(
    raw_groups: list[dict[str, Any]],
    numbers: list[list[int]],
    per_number: dict[int, Any],
    named: Sequence[tuple[str, tuple[int, ...]]],
) -> str:
    if all("param_names" in g for g in raw_groups):
        return "names"
    shapes = {n: _shape(per_number.get(n)) for nums in numbers for n in nums}
    return "order" if _by_order([n for g in numbers for n in g], shapes, named) else "shapes"


def view_of_optimizer(optimizer: Any, named: Iterable[tuple[str, nn.Parameter]]) -> OptimizerView:
    """The view of a live optimizer: its parameters named by identity with ``named``."""
    by_id = {id(p): name for name, p in named}
    groups = []
    states: dict[str, dict[str, Any]] = {}
    for i, group in enumerate(optimizer.param_groups):
        params = list(group.get("params") or [])
        names = [by_id.get(id(p), "?") for p in params]
        groups.append(ParamGroup(i, len(params), names, hypers(i, group)))
        for p, name in zip(params, names, strict=True):
            if p in optimizer.state:
                states[name] = dict(optimizer.state[p])
    return OptimizerView(groups, states, "identity")
