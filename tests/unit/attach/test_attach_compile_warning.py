"""torch.compile's warning about process-wide module hooks is not said because of ours
(attach/compile_warning.py), and is still said for a script's own."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from trainguard.attach.compile_warning import MESSAGE
from trainguard.attach.prestart import PreStart


def _said(prestart: PreStart) -> list[str]:
    """The global-hooks warnings of a compiled module's training call while ``prestart``'s
    hooks are in (every warning shown: ``always``, below ours when it adds one)."""
    model = torch.compile(nn.Linear(4, 1), backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prestart.install()
        try:
            model(torch.randn(2, 4)).sum().backward()  # type: ignore[no-untyped-call]
        finally:
            prestart.remove()
        filters = list(warnings.filters)
    assert not [f for f in filters if f[1] is not None and f[1].pattern == MESSAGE]  # taken out
    return [str(w.message) for w in caught if "global hooks on modules" in str(w.message)]


def test_no_compile_warning_for_our_own_hooks() -> None:
    assert _said(PreStart()) == []


def test_the_warning_stays_for_a_hook_of_the_scripts_own() -> None:
    handle = module_hooks.register_module_forward_hook(lambda module, args, out: None)
    try:
        said = _said(PreStart())
    finally:
        handle.remove()
    assert said and said[0].startswith("Using `torch.compile(module)` when there are global")
