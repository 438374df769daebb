"""The optimizer's scalar hyper-parameters, read on the host before the update: this rank's
learning rate for the step's row, and any hyper-parameter that is not finite.

A scheduler that yields a NaN or inf learning rate for one param group at one step (a
warm-up divided by zero), a weight decay or an epsilon turned NaN: the update that reads it
writes NaN into that group's weights, and only the next step's forward fails, far from the
cause. So the step's row carries it (``LocalReport.lr``): NaN when any scalar
hyper-parameter of any group (a float, or a float in a tuple: Adam's betas) is not finite,
else the largest finite learning rate of the groups (a Python number or a CPU tensor; 0.0:
not a host number, e.g. a device tensor of a capturable optimizer, which is not read: that
would sync). A NaN there makes
the step bad on every rank before the optimizer step (``Agreement.hyper_ranks``, where
``"hyperparameter"``), and ``nonfinite_hyperparameters`` names the group and the option for
the event and the bundle. Plain dict reads, no device work; a few microseconds a step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def row_lr(optimizer: torch.optim.Optimizer) -> float:
    """This rank's learning rate for the step's row (the module docstring): NaN when a
    scalar hyper-parameter is not finite (a CPU tensor LR too), else the largest positive
    finite LR, 0.0 when none is a host number (``host_number``)."""
    top = 0.0
    for group in optimizer.param_groups:
        for value in group.values():
            kind = type(value)
            if kind is float:
                if value - value != 0.0:  # NaN or +-inf
                    return math.nan
            elif kind is tuple:  # Adam's betas: a loop, not a call (every step)
                for item in value:
                    if type(item) is float and item - item != 0.0:
                        return math.nan
        lr = group.get("lr")
        if type(lr) is not float:  # the usual case needs no call
            lr = host_number(lr)
        if lr is not None:
            if lr - lr != 0.0:  # a tensor LR that is NaN or inf
                return math.nan
            if lr > top:
                top = lr
    return top


def nonfinite_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every scalar hyper-parameter of this rank's optimizer that is not finite:
    ``{"group": index, "name": "lr", "value": nan}`` (an item of a tuple: ``"betas[1]"``)."""
    found: list[dict[str, Any]] = []
    for index, group in enumerate(optimizer.param_groups):
        for name, value in group.items():
            if isinstance(value, Tensor):  # a CPU tensor LR is read as the row reads it
                value = host_number(value) if name == "lr" else None
            if isinstance(value, float) and not math.isfinite(value):
                found.append({"group": index, "name": name, "value": value})
            elif isinstance(value, tuple):
                for i, item in enumerate(value):
                    if isinstance(item, float) and not math.isfinite(item):
                        found.append({"group": index, "name": f"{name}[{i}]", "value": item})
    return found


def recorded_lrs(
    optimizer: torch.optim.Optimizer,
) -> tuple[float | None, list[float | None] | None]:
    """The learning rates a step's record holds: the first param group's, and every group's
    when there are several (None with one group: the first says it). Each a host number
    (``host_number``), None where it is not one."""
    groups = optimizer.param_groups
    if not groups:
        return None, None
    first = groups[0].get("lr")
    if type(first) is not float:  # the usual case needs no call
        first = host_number(first)
    if len(groups) < 2:
        return first, None
    return first, [host_number(group.get("lr")) for group in groups]


def host_number(value: object) -> float | None:
    """A scalar hyper-parameter as a host float without a device sync: a Python number, or a
    one-element CPU tensor; None for a device tensor (a capturable optimizer's: reading it
    would sync) or anything else."""
    if type(value) is float:  # the usual case
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, Tensor) and value.device.type == "cpu" and value.numel() == 1:
        return float(value.item())
    return None


def describe(found: list[dict[str, Any]]) -> str:
    """``param group 1's lr is nan`` (joined by "; ")."""
    return "; ".join(f"param group {h['group']}'s {h['name']} is {h['value']}" for h in found)
