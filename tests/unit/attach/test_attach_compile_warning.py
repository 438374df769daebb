"""torch.compile's warning about process-wide module hooks is not said because of ours
(attach/compile_warning.py), and is still said for a script's own."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from trainguard.attach.compile_warning import MESSAGE, TRACE_MESSAGE
from trainguard.attach.prestart import PreStart


def _said(prestart: PreStart, in_place: bool = False, about: str = "global hooks") -> list[str]:
    """The warnings ``about`` something of a compiled module's training call while
    ``prestart``'s hooks are in (every warning shown: ``always``, below ours when it adds
    one). ``in_place``: ``model.compile()``, else ``torch.compile(model)``."""
    from torch._dynamo.utils import warn_once_cache

    torch._dynamo.reset()  # trace again: no code compiled by an earlier test
    for said in [m for m in warn_once_cache if about in m]:  # dynamo says each one once
        warn_once_cache.discard(said)
    model = nn.Linear(4, 1)
    if in_place:
        model.compile(backend="eager")
    else:
        model = torch.compile(model, backend="eager")  # type: ignore[assignment]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prestart.install()
        try:
            model(torch.randn(2, 4)).sum().backward()  # type: ignore[no-untyped-call]
        finally:
            prestart.remove()
        filters = list(warnings.filters)
    ours = [f for f in filters if f[1] is not None and f[1].pattern in (MESSAGE, TRACE_MESSAGE)]
    assert not ours  # taken out with the hooks
    return [str(w.message) for w in caught if about in str(w.message)]


def test_no_compile_warning_for_our_own_hooks() -> None:
    assert _said(PreStart()) == []


def test_the_warning_stays_for_a_hook_of_the_scripts_own() -> None:
    handle = module_hooks.register_module_forward_hook(lambda module, args, out: None)
    try:
        said = _said(PreStart())
    finally:
        handle.remove()
    assert said and said[0].startswith("Using `torch.compile(module)` when there are global")


def test_no_trace_warning_for_our_hooks_inside_a_model_compiled_in_place() -> None:
    """``model.compile()`` runs the process-wide hooks inside the compiled call: dynamo
    warned that it cannot trace their thread check (the control: without the filter)."""
    assert _said(PreStart(), in_place=True, about="_thread.get_ident") == []
    unquiet = PreStart()
    unquiet._quiet.quiet = lambda: None  # type: ignore[method-assign]
    said = _said(unquiet, in_place=True, about="_thread.get_ident")
    assert said and said[0].startswith("Dynamo does not know how to trace the builtin")
