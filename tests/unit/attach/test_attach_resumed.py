"""The optimizer's own update count that ``trainguard run`` counts on from (attach/resumed.py)."""

from __future__ import annotations

import torch
from torch import nn

from trainguard.attach.resumed import updates_of


def _stepped(optimizer: torch.optim.Optimizer, model: nn.Module, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(3, 2)).sum().backward()  # type: ignore[no-untyped-call]
        optimizer.step()


def test_the_count_is_the_updates_every_parameter_state_holds() -> None:
    model = nn.Linear(2, 1)
    adam = torch.optim.AdamW(model.parameters())
    assert updates_of(adam) == 0  # no state yet: a fresh start
    _stepped(adam, model, 2)
    assert updates_of(adam) == 2
    loaded = torch.optim.AdamW(model.parameters())
    loaded.load_state_dict(adam.state_dict())  # a script's own resume
    assert updates_of(loaded) == 2


def test_no_count_is_none() -> None:
    model = nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _stepped(sgd, model, 1)
    assert updates_of(sgd) is None  # SGD keeps no count
    adam = torch.optim.AdamW(model.parameters())
    _stepped(adam, model, 1)
    adam.state[model.bias]["step"] = torch.tensor(5.0)  # the parameters disagree
    assert updates_of(adam) is None


class _Counted(torch.Tensor):
    """A tensor subclass (as a DTensor is): its reads may be collectives."""


def test_a_tensor_subclass_count_is_not_read() -> None:
    model = nn.Linear(2, 1)
    adam = torch.optim.AdamW(model.parameters())
    _stepped(adam, model, 1)
    for state in adam.state.values():
        state["step"] = torch.tensor(1.0).as_subclass(_Counted)
    assert updates_of(adam) is None
