"""The launcher's SIGTERM: the state at the failure is written before the rank ends.

torchrun's agent SIGTERMs the other workers of a node within a fraction of a second of one
failing (SIGKILL after its grace period), before any watchdog sees the failure, and the
main thread may be blocked inside a collective, where no Python handler runs. So SIGTERM gets
a Python handler (the one in force before is kept and called) and a wakeup file descriptor
(``signal.set_wakeup_fd``): the interpreter's C-level handler writes the signal's number to
it at once, and a thread of ours waiting on it writes the state (``FailureWriter.save``,
bounded). Then the rank ends as SIGTERM would have ended it: by the default action when
that was in force (exit status: the signal's), else by the handler that was (a preemption
checkpoint's), which runs in the main thread when it next runs Python code. When the
watchdog is ending the rank already (its state written first), it gets ``EXIT_GRACE`` to
exit with its own status (91 or 92, which say why) before that.

A forked child (a DataLoader worker, which its loader may SIGTERM) gets the handler, the
descriptor and the pipe of its parent: at the fork they are put back to what was before in
the child (``os.register_at_fork``), so that its SIGTERM neither writes a state nor wakes the
parent's thread. SIGTERM is blocked in the forking thread across the fork, so a child
SIGTERMed before it put them back gets the signal only after (its default action then).

Left alone: a process whose wakeup descriptor is taken (an asyncio loop in the main thread)
keeps it, and saves only from the handler, in the main thread; a guard built outside the
main thread installs nothing; a handler installed after the guard replaces this one.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_active: list[TerminateSave] = []
"""The installed ones (the fork hook undoes them in a child)."""
_fork_hook = False
_blocked_at_fork = False
"""Whether ``_before_fork`` blocked SIGTERM (it was not blocked already)."""


class Saver(Protocol):
    def save(self, trigger: str) -> Any: ...


class TerminateSave:
    """Installs the handler and its thread on construction; ``close()`` puts back what was."""

    def __init__(self, saver: Saver) -> None:
        self._saver = saver
        self._previous: Any = None
        self._installed = False
        self._fds: tuple[int, int] | None = None
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN or previous is None:
            return  # ignored, or a handler not set from Python: left as it is
        self._previous = previous
        signal.signal(signal.SIGTERM, self._handler)
        self._installed = True
        _active.append(self)
        _register_fork_hook()
        read, write = os.pipe()
        os.set_blocking(write, False)
        if signal.set_wakeup_fd(write, warn_on_full_buffer=False) != -1:
            signal.set_wakeup_fd(-1)  # another's: put back below, ours closed
            os.close(read)
            os.close(write)
            return
        self._fds = (read, write)
        threading.Thread(
            target=self._wait, args=(read,), name="trainguard-sigterm", daemon=True
        ).start()

    def _wait(self, read: int) -> None:
        while True:
            try:
                data = os.read(read, 512)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self._saver.save("SIGTERM")
                _leave_to_the_watchdog(self._saver)
                if self._previous is signal.SIG_DFL:
                    _die_by_sigterm()
                return

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self._saver.save("SIGTERM")
        _leave_to_the_watchdog(self._saver)
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def close(self) -> None:
        """Put back the handler and wakeup descriptor (main thread; idempotent)."""
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._installed = False
        if self in _active:
            _active.remove(self)
        if signal.getsignal(signal.SIGTERM) == self._handler:
            signal.signal(signal.SIGTERM, self._previous)
        fds, self._fds = self._fds, None
        if fds is not None:
            signal.set_wakeup_fd(-1)
            for fd in (fds[1], fds[0]):  # the write end first: the thread reads EOF
                with contextlib.suppress(OSError):
                    os.close(fd)


def _before_fork() -> None:
    global _blocked_at_fork
    _blocked_at_fork = False
    if _active:
        with contextlib.suppress(ValueError, OSError):
            before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            _blocked_at_fork = signal.SIGTERM not in before


def _unblock_after_fork() -> None:
    global _blocked_at_fork
    if _blocked_at_fork:
        _blocked_at_fork = False
        with contextlib.suppress(ValueError, OSError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _after_fork_in_child() -> None:
    """In a forked child: the parent's handler, wakeup descriptor and pipe are not its own."""
    try:
        _undo_in_child()
    finally:
        _unblock_after_fork()


def _undo_in_child() -> None:
    while _active:
        save = _active.pop()
        with contextlib.suppress(ValueError, OSError):  # not the child's main thread
            signal.set_wakeup_fd(-1)
            if signal.getsignal(signal.SIGTERM) == save._handler:
                signal.signal(signal.SIGTERM, save._previous)
        fds, save._fds = save._fds, None
        save._installed = False
        for fd in fds or ():
            with contextlib.suppress(OSError):
                os.close(fd)


def _register_fork_hook() -> None:
    global _fork_hook
    if not _fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(
            before=_before_fork,
            after_in_parent=_unblock_after_fork,
            after_in_child=_after_fork_in_child,
        )
        _fork_hook = True


EXIT_GRACE = 5.0
"""Seconds a SIGTERM waits, once the state is written, for the watchdog's own exit."""


def _leave_to_the_watchdog(saver: Saver) -> None:
    """The watchdog is ending the process (91 or 92, which say why) and a launcher's SIGTERM
    came meanwhile: the watchdog exits as soon as the state it waited for is written, so
    give it that moment rather than end the rank as a plain SIGTERM (-15)."""
    if getattr(saver, "exiting", False):
        time.sleep(EXIT_GRACE)


def _die_by_sigterm() -> None:
    """End the process by SIGTERM's default action, from any thread (the interpreter's
    ``signal.signal`` is the main thread's only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(int(signal.SIGTERM), None)  # SIG_DFL is 0
        os.kill(os.getpid(), signal.SIGTERM)
    except Exception as exc:  # no libc: the exit status of a SIGTERM, without the signal
        logger.debug("trainguard: SIGTERM's default action not restored: %s", exc)
        os._exit(128 + int(signal.SIGTERM))
