"""A package's public names imported on first use (PEP 562), so that importing the package
costs nothing until a name is used: ``import trainguard`` and ``trainguard report`` import no
torch (``tests/unit/test_layout.py``, ``tests/cli/test_report.py``)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_names(
    package: str, where: Mapping[str, str], public: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``where`` maps each lazy name to
    the module that defines it (imported at the name's first use, then kept in the package);
    ``public`` is the package's ``__all__``."""
    names = sorted(set(public))

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # once
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
