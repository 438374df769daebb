"""trainguard run's bootstrap: Python imports this at start-up from ``PYTHONPATH``.

``trainguard run`` puts this folder first on ``PYTHONPATH`` and its options in
``TRAINGUARD_RUN`` (JSON). In every Python process of the job this file then

1. runs the ``sitecustomize`` that was on the path before (chained, so a site's own
   customisation still runs);
2. does nothing more unless ``TRAINGUARD_RUN`` is set, and nothing in torchrun's agent
   (a torchrun launch whose process has no ``LOCAL_RANK``: the workers have one);
3. waits for ``torch`` to be imported (an import hook; a process that never imports torch
   pays nothing) and then installs trainguard's lazy hooks
   (``trainguard.attach.hooks.install``). They attach the guard at the first optimizer step,
   so DataLoader workers and helper processes that never step an optimizer never attach.

However the program reaches torch: ``import torch``, ``importlib.import_module``, a library
that looks torch up first (``importlib.util.find_spec("torch")``: ``transformers`` and
``datasets`` do, and every look-up makes a new spec and loader), a loader of its own. The
hook stays on ``sys.meta_path`` until torch's import has run: each spec it hands out runs the
install once torch's module has executed, and any later import, of whatever module, finds
torch imported and installs then (a way in that bypassed the specs). Whichever comes first
installs, once.

Only the standard library is imported here: this runs in every Python process of the job.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

ENV_VAR = "TRAINGUARD_RUN"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (the one this file shadows)."""
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # as site.py does: a broken sitecustomize is reported, not fatal
        sys.stderr.write(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE: {exc}\n")


def _options() -> dict[str, Any] | None:
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return None
    try:
        options = json.loads(raw)
    except ValueError:
        sys.stderr.write(f"trainguard: {ENV_VAR} is not JSON; the guard is not attached\n")
        return None
    return options if isinstance(options, dict) else None


def _is_torchrun_agent(options: dict[str, Any]) -> bool:
    """torchrun's agent launches the workers; only the workers (``LOCAL_RANK`` set) train."""
    return options.get("launcher") == "torchrun" and "LOCAL_RANK" not in os.environ


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Calls ``install`` once ``import torch`` has finished (a post-import hook), however the
    program reached torch (the module docstring)."""

    def __init__(self, options: dict[str, Any]) -> None:
        self._options = options
        self._looking = False
        self._executing = False
        """Inside torch's import by a spec of ours (its own imports are not the end of it)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if self._looking:
            return None  # our own look-up of torch below
        if fullname != "torch":
            if not self._executing and _imported("torch"):  # a way that bypassed our specs
                self.done()
            return None
        self._looking = True
        try:
            spec = importlib.util.find_spec("torch")
        finally:
            self._looking = False
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_install(module: ModuleType) -> None:
            self._executing = True
            try:
                exec_module(module)
            finally:
                self._executing = False
            self.done()

        loader.exec_module = exec_then_install  # type: ignore[method-assign]
        return spec

    def done(self) -> None:
        """Torch is imported: leave the import system and install the hooks (once)."""
        if self not in sys.meta_path:
            return
        sys.meta_path.remove(self)
        _install(self._options)


def _imported(name: str) -> bool:
    """``name`` is in ``sys.modules`` and its import has finished."""
    module = sys.modules.get(name)
    if module is None:
        return False
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def _install(options: dict[str, Any]) -> None:
    try:
        from trainguard.attach.hooks import install
    except Exception as exc:
        sys.stderr.write(f"trainguard: not attached: trainguard cannot be imported: {exc}\n")
        return
    install(options)


def _main() -> None:
    _chain()
    options = _options()
    if options is None or _is_torchrun_agent(options):
        return
    if "torch" in sys.modules:  # imported by a chained sitecustomize or a .pth file
        _install(options)
    else:
        sys.meta_path.insert(0, _AfterTorch(options))


_main()
