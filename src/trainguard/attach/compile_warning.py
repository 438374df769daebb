"""torch.compile's warning about process-wide module hooks, kept quiet while ours are in.

Until the first optimizer step ``trainguard run`` records the outermost module calls with two
process-wide module hooks (``prestart.py``). A script that compiles its model
(``model = torch.compile(model)``: nanoGPT's default) calls the compiled module during that
first step, and torch warns at each call of a compiled module while any process-wide hook is
in: "Using `torch.compile(module)` when there are global hooks on modules ... fire an extra
time". The hooks are ours, they expect that extra call (``prestart`` leaves the compiled
wrapper's inner call alone), and they are gone at the first optimizer step: the line
would only be the guard changing the script's output, and pointing its author at hooks the
script does not have.

So while our hooks are in, one ``ignore`` filter for that message (and only it) heads
``warnings.filters``; it is taken out with the hooks. Not added when the process already
had a process-wide hook of its own at install: the warning is then about that hook, and the
script's. An ``ignore`` leaves no mark in a module's warning registry, so a warning that
was due to a hook of the script's, added during our first step, is shown at the next call.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.nn.modules import module as module_hooks

MESSAGE = r"Using `torch\.compile\(module\)` when there are global hooks on modules"
"""The start of torch's warning (``torch/_dynamo/eval_frame.py``, ``OptimizedModule``)."""


def has_global_hooks() -> bool:
    """Whether any process-wide module hook is in (torch's own test, where it has one)."""
    check = getattr(module_hooks, "_has_any_global_hook", None)
    return bool(check()) if check is not None else False


class QuietCompileWarning:
    """``quiet()`` before our process-wide hooks go in, ``restore()`` once they are out."""

    def __init__(self) -> None:
        self._entry: tuple[Any, ...] | None = None

    def quiet(self) -> None:
        if self._entry is not None or has_global_hooks():
            return
        warnings.filterwarnings("ignore", message=MESSAGE, category=UserWarning)
        self._entry = warnings.filters[0]

    def restore(self) -> None:
        entry, self._entry = self._entry, None
        if entry is None:
            return
        filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list, typed Sequence
        try:
            filters.remove(entry)
        except ValueError:  # the script's own catch_warnings() put its list back
            return
        mutated = getattr(warnings, "_filters_mutated", None)  # the filters' cache
        if mutated is not None:
            mutated()
