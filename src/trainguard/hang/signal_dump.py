"""Stacks left by a rank that a signal ends before any Python code can run.

A fatal signal (``SIGSEGV``, ``SIGABRT``, ``SIGBUS``, ``SIGFPE``, ``SIGILL``) kills the
process at once: gloo aborts a rank whose collective does not match its peer's in size
(``gloo::EnforceNotMet`` escaping its thread calls ``std::terminate``), a native extension
crashes, a CUDA error aborts. ``SIGTERM`` is how a launcher ends the other ranks after one
failed (torchrun), and how a scheduler preempts a job; its default action kills the process
without a word either. Neither leaves the watchdog a chance to dump anything.

``SignalDump`` hands both to :mod:`faulthandler`, whose C handler writes every thread's
Python stack (the main thread's with the loop's line) to ``rank-<r>.signal.txt`` in the
run's hang folder, then lets the signal do what it did before: faulthandler re-raises a
fatal signal (the exit status stays the signal's) and chains ``SIGTERM`` to the handler it
replaced (the default, or a Python handler such as a preemption checkpoint's: it still
runs). ``trainguard report`` reads the file (``report/crashes.py``).

Left alone: a process that enabled faulthandler itself (``PYTHONFAULTHANDLER=1``,
``faulthandler.enable()``) keeps its own fatal-signal output. A forked child (a DataLoader
worker, a ``multiprocessing`` fork) drops both handlers at once (``os.register_at_fork``),
so a worker that is terminated or crashes does not write into its rank's file. The exit
path drops them before it ends the process itself (``close()``): a rank that trainguard
ends on purpose is not a crash.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
from pathlib import Path
from typing import TextIO

logger = logging.getLogger(__name__)

TERMINATE = signal.SIGTERM
"""The one non-fatal signal dumped (see the module docstring)."""

_active: SignalDump | None = None
"""The dump whose handlers are installed (one per process: faulthandler's are global)."""

_fork_hook = False
"""Whether ``_after_fork_in_child`` is registered (on the first dump: no import-time work)."""


def signal_file(rank: int) -> str:
    return f"rank-{rank}.signal.txt"


class SignalDump:
    """Installs the handlers on construction (see the module docstring); ``close()`` removes
    them and the file when nothing was written."""

    def __init__(self, path: Path) -> None:
        global _active
        self.path = path
        self._file: TextIO | None = None
        self._fatal = False
        self._terminate = False
        """Whether this dump registered the SIGTERM dump."""
        self._python_handler: object = None
        """The Python-level SIGTERM handler when this dump registered (see ``_drop_handlers``)."""
        if _active is not None:
            return  # another guard of this process holds faulthandler's handlers
        _register_fork_hook()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._fatal = not faulthandler.is_enabled()
        if self._fatal:
            faulthandler.enable(file=self._file, all_threads=True)
        register = getattr(faulthandler, "register", None)  # absent on Windows
        try:
            if register is not None:
                self._python_handler = signal.getsignal(TERMINATE)
                register(TERMINATE, file=self._file, all_threads=True, chain=True)
                self._terminate = True
        except (RuntimeError, ValueError, OSError) as exc:  # not the main interpreter
            logger.debug("trainguard: no SIGTERM stack dump: %s", exc)
        _active = self

    def close(self) -> None:
        """Remove the handlers, close the file and remove it when empty (idempotent)."""
        global _active
        if self._file is None:
            return
        _drop_handlers(self)
        _active = None
        self._file.close()
        self._file = None
        try:
            if self.path.stat().st_size == 0:
                self.path.unlink()
        except OSError:
            pass


def _drop_handlers(dump: SignalDump) -> None:
    """Remove ``dump``'s handlers (the ``SIGTERM`` one, and the fatal ones it enabled).
    Unregistering puts back the handler faulthandler replaced; a Python ``SIGTERM`` handler
    installed since (a preemption handler a framework sets when training starts) replaced
    faulthandler's already and must stay: then it is left as it is."""
    if dump._terminate and signal.getsignal(TERMINATE) is dump._python_handler:
        faulthandler.unregister(TERMINATE)
    dump._terminate = False
    if dump._fatal:
        faulthandler.disable()  # before the file closes: its descriptor may be reused
        dump._fatal = False


def _after_fork_in_child() -> None:
    """A forked child is not its rank: it must not write into the rank's file."""
    global _active
    if _active is not None:
        _drop_handlers(_active)
        _active._file = None  # the child's copy of the descriptor closes with the child
        _active = None


def _register_fork_hook() -> None:
    global _fork_hook
    if not _fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook = True
