"""Where an op runs: its module (from global forward hooks) and the user's ``file:line``.

Module paths come from global forward pre/post hooks (a stack of running modules, named by
``model.named_modules()``; without a model, every outermost module that runs names its own
submodules). The user's ``file:line`` is the innermost Python frame outside torch, the
standard library and trainguard's own machinery.
"""

from __future__ import annotations

import linecache
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import nn

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_SITE_DIRS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})
_OWN_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep  # the trainguard package
_OWN_USER_FILES = ("demo.py",)  # trainguard files that hold user-level model code


@dataclass
class OpSite:
    """Where an op ran."""

    op: str
    """The op, e.g. ``aten.div``."""
    overload: str
    """The exact overload, e.g. ``aten.div.Tensor``."""
    phase: str
    """``forward`` (forward pass and loss) or ``backward``."""
    module: str | None
    """The module path (``encoder.layers.3.attn``), or None outside every module."""
    in_model: bool
    """The module belongs to the replayed model (False: outside it, e.g. in loss_fn)."""
    source: str | None
    """The user's ``file:line``."""
    code: str | None
    """That line's text."""
    grad_fn: str | None = None
    """Backward ops: the autograd node that ran them (e.g. ``DivBackward0``)."""
    forward: OpSite | None = None
    """Backward ops: the forward op whose gradient they compute."""


RootHook = Callable[[nn.Module, Any], None]


class ModuleStack:
    """The modules running now, from global forward hooks, named by the model.

    ``model=None`` (live tracing): each outermost module that runs becomes a model whose
    submodules are named from it. ``on_root(module, args)`` is called the first time a
    model's outermost module runs (to tag its non-finite inputs and weights);
    ``on_outside(module)`` the first time a module outside the model runs (a loss module:
    to tag its non-finite buffers).
    """

    def __init__(self, model: nn.Module | None, on_root: RootHook | None = None) -> None:
        self._names: dict[int, str] = {}
        self._root = type(model).__name__ if model is not None else "model"
        self.roots: list[nn.Module] = []
        if model is not None:
            self._adopt(model)
        self._on_root = on_root
        self.on_outside: Callable[[nn.Module], Any] | None = None
        self._outside: set[int] = set()
        self._learn = model is None
        self._called: set[int] = set()
        self._stack: list[nn.Module] = []
        self._handles: list[Any] = []

    def _adopt(self, model: nn.Module) -> None:
        self.roots.append(model)
        self._names.update({id(m): name for name, m in model.named_modules()})

    def __enter__(self) -> ModuleStack:
        from torch.nn.modules import module as nn_module

        self._handles = [
            nn_module.register_module_forward_pre_hook(self._push),
            nn_module.register_module_forward_hook(self._pop, always_call=True),
        ]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack = []

    def _push(self, module: nn.Module, args: Any) -> None:
        if not self._stack and id(module) not in self._called:
            if self._learn and id(module) not in self._names:
                self._root = type(module).__name__
                self._adopt(module)
            if self._on_root is not None and id(module) in self._names:
                self._called.add(id(module))
                self._on_root(module, args)
        if id(module) not in self._names and id(module) not in self._outside:
            self._outside.add(id(module))
            if self.on_outside is not None:
                self.on_outside(module)
        self._stack.append(module)

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        while self._stack:
            if self._stack.pop() is module:
                break

    def current(self) -> tuple[str | None, bool]:
        """``(path, in_model)`` of the innermost running module; ``(None, False)`` outside."""
        for module in reversed(self._stack):
            name = self._names.get(id(module))
            if name is not None:
                return (name or self._root), True
        if self._stack:
            return type(self._stack[-1]).__name__, False
        return None, False

    def path_of_parameter(self, name: str) -> str:
        owner = name.rpartition(".")[0]
        return owner or self._root


def user_frame(start: FrameType | None) -> tuple[str | None, str | None]:
    """``(file:line, code)`` of the innermost frame outside torch/stdlib/trainguard."""
    frame = start
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_internal(filename):
            code = linecache.getline(filename, frame.f_lineno).strip() or None
            return f"{_short_path(filename)}:{frame.f_lineno}", code
        frame = frame.f_back
    return None, None


def _is_internal(filename: str) -> bool:
    if filename.startswith("<"):
        return filename not in ("<stdin>", "<string>")  # <frozen ...> is internal
    if filename.startswith(_TORCH_DIR):
        return True
    if filename.startswith(_STDLIB_DIR) and not filename.startswith(_SITE_DIRS):
        return True
    return filename.startswith(_OWN_DIR) and os.path.basename(filename) not in _OWN_USER_FILES


def _short_path(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return rel if not rel.startswith("..") else filename
