"""``torch.save`` on the loop's thread is a ``save`` phase while a guard watches for hangs.

The classic false hang: rank 0 alone writes the checkpoint (``if rank == 0:
torch.save(...)``) while the other ranks go on to the next step's collective and wait for
it. A large save outlasts the learned hang timeout (30 s at least: ``timeout.py``), and a
watchdog that counted only training progress would end a healthy job. ``guard.phase("save")``
around the save is the fix a script can make; an unmodified script (``trainguard run``)
cannot, and a script written without docs/hangs.md in mind does not.

``SaveMarks.watch(progress, thread)`` makes every ``torch.save`` called on ``thread`` (the
thread that built the guard: the training loop's) run inside a user phase named ``save``
of that guard's ``Progress``, which the hang rule never takes for a hang unless it is a
deadlock (``rules.py``; ``torch.save`` itself runs no collective) and the learner of the
timeout does not measure. A save on another thread (an asynchronous checkpoint written
while the loop trains) marks nothing: the loop's own progress goes on and still counts.
``torch.save`` releases the GIL while it writes, so the rank's heartbeat goes on too.

The wrapper is process-wide (``torch.save``, and ``torch.serialization.save`` when it is
the same function), installed with the first guard that asks and put back when the last one
is released, unless something else replaced it since (then that is left as it is). ``from
torch import save`` made before the guard keeps the original: such saves are not marked.
A save that never ends (a file system that hangs) is not a hang either, as under
``guard.phase``: the other ranks' collective timeout ends the job.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.serialization

from trainguard.hang.progress import Progress

SAVE_PHASE = "save"
"""The user phase a marked ``torch.save`` runs in (the hang report shows it)."""

_Watched = tuple[Progress, int]


class SaveMarks:
    """The process-wide ``torch.save`` wrapper and the guards' progress it marks."""

    def __init__(self) -> None:
        self._watched: list[_Watched] = []
        self._original: Callable[..., Any] | None = None
        self._wrapper: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def watch(self, progress: Progress, thread: int | None = None) -> SaveMarking:
        """Mark ``torch.save`` on ``thread`` (default: this one) for ``progress`` until the
        returned marking is closed."""
        entry = (progress, threading.get_ident() if thread is None else thread)
        with self._lock:
            self._watched.append(entry)
            if self._wrapper is None:
                self._install()
        return SaveMarking(self, entry)

    def _release(self, entry: _Watched) -> None:
        with self._lock:
            # by identity: two guards' Progress objects may compare equal (a dataclass)
            self._watched = [e for e in self._watched if e is not entry]
            if not self._watched:
                self._uninstall()

    def _install(self) -> None:
        original = torch.save  # what scripts call (someone else's wrapper, if any, stays)

        @functools.wraps(original)
        def save(*args: Any, **kwargs: Any) -> Any:
            here = threading.get_ident()
            mine = [p for p, thread in tuple(self._watched) if thread == here]
            if not mine:
                return original(*args, **kwargs)
            previous = [p.push_phase(SAVE_PHASE) for p in mine]
            try:
                return original(*args, **kwargs)
            finally:
                for progress, phase in zip(mine, previous, strict=True):
                    progress.pop_phase(phase)

        self._original, self._wrapper = original, save
        if torch.serialization.save is original:
            torch.serialization.save = save
        torch.save = save

    def _uninstall(self) -> None:
        original, wrapper = self._original, self._wrapper
        self._original = self._wrapper = None
        for namespace in (torch, torch.serialization):
            if getattr(namespace, "save", None) is wrapper:
                namespace.save = original  # type: ignore[attr-defined]


class SaveMarking:
    """One guard's marking (``SaveMarks.watch``); ``close()`` ends it (idempotent: the
    guard's close and its unclosed-release may both call it)."""

    def __init__(self, marks: SaveMarks, entry: _Watched) -> None:
        self._marks: SaveMarks | None = marks
        self._entry = entry

    def close(self) -> None:
        marks, self._marks = self._marks, None
        if marks is not None:
            marks._release(self._entry)


SAVES = SaveMarks()
"""The process's one ``torch.save`` wrapper (nothing is installed until a guard asks)."""
