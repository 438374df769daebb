"""Hooks trainguard puts on the user's modules, kept out of the modules' copies.

A module's hooks live in its ``__dict__`` (``_forward_pre_hooks``, ``_forward_hooks``), so
every copy of the module carries them: ``torch.save(model)`` pickles them and
``copy.deepcopy(model)`` (an EMA copy, a frozen reference model) copies them. A bound method
of one of the guard's parts drags the guard along: the pickle fails on its lambdas ("Can't
pickle local object '...<lambda>'"), and a deep copy duplicates the part with what it holds
(stored buffers, RNG snapshots, recovery's snapshots through the step-start callback), whose
copy the copied module then calls at its every forward.
(An optimizer's copies carry no hooks: its ``__getstate__`` leaves them out.)

``Hook`` wraps the callback instead. Pickled or deep-copied, a ``Hook`` is inert: it calls
nothing and holds nothing, so a copy of a guarded module is the user's module and nothing of
the guard (loading such a pickle needs trainguard importable, as a pickle needs every class
it names). The guarded module itself keeps its working hooks. The copy keeps the inert
entries in its hook dicts (a copy cannot drop them): a no-op call per forward of the copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Hook:
    """A hook that calls ``callback``; its copies (pickle, ``deepcopy``) call nothing."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[..., Any] | None) -> None:
        self.callback = callback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        callback = self.callback
        return None if callback is None else callback(*args, **kwargs)

    def __reduce__(self) -> tuple[type[Hook], tuple[None]]:
        return (Hook, (None,))

    def __deepcopy__(self, memo: dict[int, Any]) -> Hook:
        return Hook(None)

    @property
    def inert(self) -> bool:
        """Whether this is a copy (it calls nothing)."""
        return self.callback is None
