"""torch.compile's warnings about our process-wide module hooks, kept quiet while they are in.

Until the first optimizer step ``trainguard run`` records the outermost module calls with two
process-wide module hooks (``prestart.py``). A script that compiles its model
(``model = torch.compile(model)``: nanoGPT's default) calls the compiled module during that
first step, and torch warns at each call of a compiled module while any process-wide hook is
in: "Using `torch.compile(module)` when there are global hooks on modules ... fire an extra
time". The hooks are ours, they expect that extra call (``prestart`` leaves the compiled
wrapper's inner call alone), and they are gone at the first optimizer step: the line
would only be the guard changing the script's output, and pointing its author at hooks the
script does not have.

A model compiled in place (``model.compile()``) runs the process-wide hooks inside its
compiled call: dynamo traces them, cannot trace their thread check (``_thread.get_ident``),
warns so ("Dynamo does not know how to trace the builtin `_thread.get_ident.`"), breaks the
graph there and runs the hooks eagerly. The same: a line of ours in the script's output.

The first line is more than noise under warnings as errors (``python -W error``, as test
suites and CI run): the script ended with that UserWarning under ``trainguard run`` while it
ran bare. (A model compiled in place still does under ``-W error``: tracing the hooks, dynamo
also reads the call's tensors and torch warns inside it of a non-leaf tensor's ``.grad``, a
warning this filter must not hide from the script's own code.)

So while our hooks are in, ``ignore`` filters for those two messages (and only them) head
``warnings.filters``; they are taken out with the hooks. The global-hooks one is not added
when the process already had a process-wide hook of its own at install: the warning is then
about that hook, and the script's. An ``ignore`` leaves no mark in a module's warning
registry, so the global-hooks warning due to a hook of the script's own, added during our
first step, is shown at the next call; dynamo says its trace warning once a process, so one
the script's own compiled code would have caused during that step is not said again.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.nn.modules import module as module_hooks

MESSAGE = r"Using `torch\.compile\(module\)` when there are global hooks on modules"
"""The start of torch's warning (``torch/_dynamo/eval_frame.py``, ``OptimizedModule``)."""
TRACE_MESSAGE = r"Dynamo does not know how to trace the builtin `_thread\.get_ident"
"""The start of dynamo's warning when it traces the hooks' thread check."""


def has_global_hooks() -> bool:
    """Whether any process-wide module hook is in (torch's own test, where it has one)."""
    check = getattr(module_hooks, "_has_any_global_hook", None)
    return bool(check()) if check is not None else False


class QuietCompileWarning:
    """``quiet()`` before our process-wide hooks go in, ``restore()`` once they are out."""

    def __init__(self) -> None:
        self._entries: list[tuple[Any, ...]] = []

    def quiet(self) -> None:
        if self._entries:
            return
        messages = [TRACE_MESSAGE] if has_global_hooks() else [TRACE_MESSAGE, MESSAGE]
        for message in messages:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
            self._entries.append(warnings.filters[0])

    def restore(self) -> None:
        entries, self._entries = self._entries, []
        filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list, typed Sequence
        for entry in entries:
            if entry in filters:  # else the script's own catch_warnings() put its list back
                filters.remove(entry)
        mutated = getattr(warnings, "_filters_mutated", None)  # the filters' cache
        if entries and mutated is not None:
            mutated()
