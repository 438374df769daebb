"""The launcher's SIGTERM: the state at the failure is written before the rank ends.

torchrun's agent SIGTERMs the other workers of a node within a fraction of a second of one
failing (SIGKILL after its grace period), before any watchdog sees the failure, and the
main thread may be blocked inside a collective, where no Python handler runs. So SIGTERM gets
a Python handler (the one in force before is kept and called) and a wakeup file descriptor
(``signal.set_wakeup_fd``): the interpreter's C-level handler writes the signal's number to
it at once, and a thread of ours waiting on it writes the state (``FailureWriter.save``,
bounded). Then the rank ends as SIGTERM would have ended it: by the default action when
that was in force (exit status: the signal's), else by the handler that was (a preemption
checkpoint's), which runs in the main thread when it next runs Python code.

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
from types import FrameType
from typing import Any, Protocol

logger = logging.getLogger(__name__)


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
                if self._previous is signal.SIG_DFL:
                    _die_by_sigterm()
                return

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self._saver.save("SIGTERM")
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
        if signal.getsignal(signal.SIGTERM) is self._handler:
            signal.signal(signal.SIGTERM, self._previous)
        fds, self._fds = self._fds, None
        if fds is not None:
            signal.set_wakeup_fd(-1)
            for fd in (fds[1], fds[0]):  # the write end first: the thread reads EOF
                with contextlib.suppress(OSError):
                    os.close(fd)


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
