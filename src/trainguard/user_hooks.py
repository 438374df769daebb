"""Hooks trainguard puts on the user's modules, kept out of the modules' copies.

A module's hooks live in its ``__dict__`` (``_forward_pre_hooks``, ``_forward_hooks``), so
every copy of the module carries them: ``torch.save(model)`` pickles them and
``copy.deepcopy(model)`` (an EMA copy, a frozen reference model) copies them. A bound method
of one of the guard's parts drags the guard along: the pickle fails on its lambdas ("Can't
pickle local object '...<lambda>'"), and a deep copy duplicates the part with what it holds
(stored buffers, RNG snapshots, recovery's snapshots through the step-start callback), whose
copy the copied module then calls at its every forward.
(An optimizer's copies carry no hooks: its ``__getstate__`` leaves them out.)

So the copies of a module leave the guard's hooks out: while a guard's hook is on some
module, ``nn.Module.__reduce_ex__`` (what ``pickle``, ``torch.save``, ``copy.deepcopy`` and
``copy.copy`` call on every module, whatever its ``__getstate__``: DDP's and a compiled
wrapper's included) is the standard one followed by ``without_guard_hooks``: the state it
returns holds the module's hook dicts without the guard's ``Hook`` entries (new dicts; the
live module keeps its own, its working hooks and the user's). A module saved whole is the
user's module, bit for bit what the unguarded run would pickle: ``torch.load(...,
weights_only=True)`` takes it (a pickled hook is a global the safe loader refuses), and a
deep copy (an EMA, a frozen reference model) runs no hook of the guard's. A module with no
guard hook reduces exactly as before.

``Hook`` wraps the callback, and stays inert wherever it is copied by other ways (a hook
dict pickled on its own): a copy calls nothing and holds nothing; pickled, it is the
standard library's no-op, ``functools.partial(contextlib.nullcontext.__exit__, None)``.

Compiled modules. A hook runs where the module's call runs, and under ``torch.compile`` that
can be inside a frame dynamo traces: the module inside ``torch.compile(model)``'s wrapper
(``OptimizedModule``), or a module compiled in place (``module.compile()``: its whole call,
hooks included, is compiled). Traced, a hook of the guard's would become part of the graph:
dynamo guards on the step counter it compares, so the model recompiles at every step and
falls back to eager after ``torch._dynamo.config.recompile_limit`` steps (torch.compile
silently lost); and the clock or RNG work it does could not be traced at all. So:

- a ``Hook`` on a module inside ``torch.compile(model)``'s wrapper (``inside_compiled``) does
  nothing while dynamo traces (``torch.compiler.is_compiling()``, a constant in the trace):
  the wrapper's own hook, run eagerly, did its work; ``eager_module`` names the innermost
  module whose hooks run eagerly;
- ``add_forward_hooks`` puts the hooks of a module compiled in place around its compiled
  call instead (``EagerCalls`` as its ``_compiled_call_impl``), where they run eagerly, once
  per call; any other module gets ordinary hooks;
- any other ``Hook`` traced by dynamo (the model called inside a compiled function of the
  loop's, ``torch.compile(loss_fn)``: no wrapper of the model's own runs eagerly) runs
  through ``torch._dynamo.disable``: a graph break, its callback run eagerly, nothing of it in
  the graph and no guard on what it reads (``prepare_eager`` makes that runner once dynamo is
  imported: the guard calls it when built and when a step's start was missed; until then
  the callback is traced as before).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, SupportsIndex

import torch
from torch import nn

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_FLAG_DICTS = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
"""A module's dicts keyed by hook id beside the hooks themselves."""

_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def in_backward() -> bool:
    """Whether this thread runs inside autograd's backward. A module called there is
    activation checkpointing recomputing a forward the step already made
    (``torch.utils.checkpoint``: the non-reentrant one from the engine, on its device thread
    under CUDA; the reentrant one from its node's backward), not a call of the loop: no new
    micro-batch, no step start, no training call in another thread."""
    return _graph_task_id() != -1


def without_guard_hooks(state: dict[str, Any]) -> dict[str, Any]:
    """A module's pickled state (its ``__getstate__``) without the guard's hooks: the same
    dict when it holds none, else a copy whose hook dicts (and their flags) are new dicts
    without the guard's entries."""
    ours: set[int] = set()
    for name in _HOOK_DICTS:
        hooks = state.get(name)
        if isinstance(hooks, dict):
            ours.update(key for key, hook in hooks.items() if isinstance(hook, Hook))
    if not ours:
        return state
    state = dict(state)  # never the live module's own dicts
    for name in (*_HOOK_DICTS, *_FLAG_DICTS):
        entries = state.get(name)
        if isinstance(entries, dict):
            state[name] = OrderedDict((k, v) for k, v in entries.items() if k not in ours)
    return state


def _reduce_ex(self: nn.Module, protocol: SupportsIndex) -> str | tuple[Any, ...]:
    """``nn.Module.__reduce_ex__`` while guard hooks may be on modules: the standard one,
    its state without the guard's hooks (``without_guard_hooks``)."""
    reduced = object.__reduce_ex__(self, protocol)
    if isinstance(reduced, tuple) and len(reduced) > 2 and isinstance(reduced[2], dict):
        return (*reduced[:2], without_guard_hooks(reduced[2]), *reduced[3:])
    return reduced


def keep_hooks_out_of_copies() -> None:
    """Install ``_reduce_ex`` on ``nn.Module`` (once, process-wide; at the first guard hook,
    not at import). A subclass's own ``__reduce_ex__`` is left alone."""
    if nn.Module.__dict__.get("__reduce_ex__") is not _reduce_ex:
        nn.Module.__reduce_ex__ = _reduce_ex  # type: ignore[method-assign,assignment]


def _call(callback: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return callback(*args, **kwargs)


_eager_call: Callable[..., Any] | None = None
"""``_call`` under ``torch._dynamo.disable`` (``prepare_eager``), None until dynamo is imported."""


def prepare_eager() -> None:
    """Make the runner a traced ``Hook`` calls eagerly through, once ``torch._dynamo`` is
    imported (importing it here would cost every process a second or more)."""
    global _eager_call
    if _eager_call is None and "torch._dynamo" in sys.modules:
        _eager_call = torch.compiler.disable(_call)  # type: ignore[no-untyped-call]


def eager_when_traced(callback: Callable[..., Any]) -> Callable[..., Any]:
    """``callback`` for a hook dynamo may trace (a process-wide optimizer hook inside a
    compiled ``optimizer.step()``): traced, it calls ``callback`` under
    ``torch.compiler.disable`` (a graph break, the callback run eagerly, nothing of it in the
    graph and no guard on what it reads; traced itself, the guard's whole step path was
    compiled anew at every step until dynamo's recompile limit, with its warnings); else
    directly. The disabled wrapper is made while tracing only: dynamo is imported then."""

    def hook(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return torch.compiler.disable(callback)(*args)  # type: ignore[no-untyped-call]
        return callback(*args)

    return hook


class Hook:
    """A hook that calls ``callback``; its copies (pickle, ``deepcopy``) call nothing.
    ``inside_compiled``: the module is inside a ``torch.compile`` wrapper (module docstring)."""

    __slots__ = ("callback", "inside_compiled")

    def __init__(self, callback: Callable[..., Any] | None, inside_compiled: bool = False) -> None:
        self.callback = callback
        self.inside_compiled = inside_compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        callback = self.callback
        if callback is None:
            return None  # a copy
        if torch.compiler.is_compiling():  # traced by dynamo (module docstring)
            if self.inside_compiled:
                return None
            if _eager_call is not None:
                return _eager_call(callback, args, kwargs)
        elif in_backward():  # a checkpointed forward recomputed: the step's call was seen
            return None
        return callback(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (``torch.save(model)``): a no-op of the standard library's, so the file
        loads where trainguard is not installed (an inference server)."""
        return (functools.partial, (contextlib.nullcontext.__exit__, None))

    def __deepcopy__(self, memo: dict[int, Any]) -> Hook:
        return Hook(None)

    @property
    def inert(self) -> bool:
        """Whether this is a copy (it calls nothing)."""
        return self.callback is None


PreHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]
"""``pre(module, args, kwargs)``, before the module's call."""
PostHook = Callable[[nn.Module, tuple[Any, ...], Any], None]
"""``post(module, args, output)``, after it."""


class EagerCalls:
    """A module compiled in place: its ``_compiled_call_impl``, calling the guard's hooks
    eagerly around the compiled call. Copies of the module do not carry it (``nn.Module``'s
    ``__getstate__`` leaves ``_compiled_call_impl`` out)."""

    def __init__(self, module: nn.Module, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled
        self._module = weakref.ref(module)
        self.pre: list[Hook] = []
        self.post: list[Hook] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        for hook in self.pre:
            hook(module, args, kwargs)
        output = self.compiled(*args, **kwargs)
        for hook in self.post:
            hook(module, args, output)
        return output

    @property
    def empty(self) -> bool:
        return not self.pre and not self.post


class HookHandle:
    """Removes what ``add_forward_hooks`` added (``torch``'s handles, or the entries around a
    compiled call, and that wrapper itself once it calls nothing more)."""

    def __init__(self, remove: Callable[[], None]) -> None:
        self._remove: Callable[[], None] | None = remove

    def remove(self) -> None:
        remove, self._remove = self._remove, None
        if remove is not None:
            remove()


def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` compiled this module's call (hooks included)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def add_forward_hooks(
    module: nn.Module,
    pre: PreHook | None = None,
    post: PostHook | None = None,
    inside_compiled: bool = False,
    pre_first: bool = False,
) -> HookHandle:
    """Hooks that run eagerly at every call of ``module`` (module docstring): ``pre(module,
    args, kwargs)`` before it, ``post(module, args, output)`` after it; each a ``Hook``.
    ``inside_compiled``: ``module`` is inside a ``torch.compile`` wrapper whose own hooks
    do the work (these then do nothing in the trace). ``pre_first``: ``pre`` runs before the
    module's other pre-hooks (FSDP2's unshard among them)."""
    keep_hooks_out_of_copies()
    compiled = getattr(module, "_compiled_call_impl", None)
    if compiled is not None:  # compiled_in_place(module)
        return _around_compiled(module, compiled, pre, post, pre_first)
    handles = []
    if pre is not None:
        hook = Hook(pre, inside_compiled)
        handles.append(module.register_forward_pre_hook(hook, prepend=pre_first, with_kwargs=True))
    if post is not None:
        handles.append(module.register_forward_hook(Hook(post, inside_compiled)))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return HookHandle(remove)


def _around_compiled(
    module: nn.Module,
    compiled: Callable[..., Any],
    pre: PreHook | None,
    post: PostHook | None,
    pre_first: bool,
) -> HookHandle:
    calls = compiled if isinstance(compiled, EagerCalls) else EagerCalls(module, compiled)
    module._compiled_call_impl = calls
    entries: list[tuple[list[Hook], Hook]] = []
    if pre is not None:
        entries.append((calls.pre, Hook(pre)))
        calls.pre.insert(0 if pre_first else len(calls.pre), entries[-1][1])
    if post is not None:
        entries.append((calls.post, Hook(post)))
        calls.post.append(entries[-1][1])

    def remove() -> None:
        for hooks, hook in entries:
            if hook in hooks:
                hooks.remove(hook)
        if calls.empty and module._compiled_call_impl is calls:
            module._compiled_call_impl = calls.compiled

    return HookHandle(remove)


def eager_module(model: nn.Module) -> nn.Module:
    """The innermost module whose hooks run eagerly when the loop calls ``model``: inside DDP
    wrappers, down to a ``torch.compile`` wrapper (everything inside it is traced) or a module
    compiled in place (``add_forward_hooks`` hooks it around its compiled call)."""
    inner = model
    while type(inner).__name__ == "DistributedDataParallel" and not compiled_in_place(inner):
        wrapped = getattr(inner, "module", None)
        if not isinstance(wrapped, nn.Module):
            break
        inner = wrapped
    return inner
