"""Before the first optimizer step, ``trainguard run`` tells a script that updates its
parameters by hand (no ``torch.optim`` optimizer) at its second training forward; what
changes a module's parameters otherwise, between two forwards, is no such finding."""

from __future__ import annotations

import torch
from torch import nn

from trainguard.attach.prestart import PreStart


def _watch() -> tuple[PreStart, list[nn.Module]]:
    told: list[nn.Module] = []
    prestart = PreStart(on_manual_update=told.append)
    prestart.install()
    return prestart, told


def test_a_manual_update_is_told_and_accumulation_is_not() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    prestart, told = _watch()
    try:
        for _ in range(3):  # gradient accumulation: forwards and backwards, no update
            model(torch.randn(2, 4)).sum().backward()
        assert told == []
        with torch.no_grad():
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)  # by hand, as word-language-model does
        model(torch.randn(2, 4))
        assert told == [model]
    finally:
        prestart.remove()


def test_lazy_parameters_a_dtype_change_and_an_eval_are_not_an_update() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 1))
    prestart, told = _watch()
    try:
        model(torch.randn(2, 3))  # materialises the lazy parameters
        model(torch.randn(2, 3))
        model.double()  # every parameter changes dtype: sampled again
        model(torch.randn(2, 3, dtype=torch.float64))
        with torch.no_grad():
            model(torch.randn(2, 3, dtype=torch.float64))
        assert told == []
    finally:
        prestart.remove()
