"""Stack dumps of the local process: every thread's Python stack, py-spy's native stacks
when py-spy is installed and allowed, and a faulthandler fallback for a frozen interpreter.

The fallback: a thread that holds the GIL in C code (a C extension that does not release
it) stops every other Python thread, the watchdog included, so the watchdog cannot dump
anything. ``FrozenDump`` keeps ``faulthandler.dump_traceback_later`` armed and re-arms it
on every watchdog tick; faulthandler's own C thread needs no GIL, so when the ticks stop
for longer than the arming delay it writes every thread's Python stack to the rank's stack
file and ends the process (exit status 1).

py-spy runs when ``shutil.which("py-spy")`` finds it and ``TRAINGUARD_PY_SPY`` is not
``0``; on Linux the process first allows any process to trace it (``PR_SET_PTRACER``), so
the child py-spy may attach under Yama's default ``ptrace_scope=1``.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import shutil
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import TextIO

logger = logging.getLogger(__name__)

PY_SPY_ENV = "TRAINGUARD_PY_SPY"
PY_SPY_TIMEOUT_S = 4.0
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1)


def python_stacks() -> str:
    """Every thread's Python stack, the main thread first."""
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    main_ident = threading.main_thread().ident
    order = sorted(frames, key=lambda ident: (ident != main_ident, ident))
    parts = []
    for ident in order:
        thread = threads.get(ident)
        name = thread.name if thread is not None else "<unknown>"
        daemon = " daemon" if thread is not None and thread.daemon else ""
        parts.append(f"--- thread {name} (ident {ident}{daemon}) ---\n")
        parts.append("".join(traceback.format_stack(frames[ident])))
        parts.append("\n")
    return "".join(parts)


def py_spy_available() -> str | None:
    """The py-spy executable, when installed and allowed."""
    if os.environ.get(PY_SPY_ENV, "1") == "0":
        return None
    return shutil.which("py-spy")


def _allow_tracing() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def py_spy_stacks(pid: int, timeout: float = PY_SPY_TIMEOUT_S) -> str | None:
    """``py-spy dump --native`` of ``pid``; None when py-spy is not available."""
    exe = py_spy_available()
    if exe is None:
        return None
    _allow_tracing()
    try:
        done = subprocess.run(
            [exe, "dump", "--native", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"py-spy failed: {exc}\n"
    if done.returncode != 0:
        return f"py-spy exited with {done.returncode}: {done.stderr.strip()}\n"
    return done.stdout


def write_stack_dump(path: Path, header: str) -> bool:
    """Write ``header``, the Python stacks and (when available) py-spy's native stacks to
    ``path`` atomically. Returns whether py-spy's stacks are in it."""
    body = python_stacks()
    native = py_spy_stacks(os.getpid())
    text = f"{header}\n\n{body}"
    if native is not None:
        text += f"--- py-spy dump --native --pid {os.getpid()} ---\n{native}"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return native is not None and not native.startswith("py-spy ")


class FrozenDump:
    """The faulthandler fallback for a frozen interpreter (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = path.open("a", encoding="utf-8")

    def arm(self, seconds: float) -> None:
        """(Re-)arm: dump and exit unless ``arm`` or ``disarm`` is called within ``seconds``."""
        if self._file is not None:
            faulthandler.dump_traceback_later(seconds, repeat=False, file=self._file, exit=True)

    def disarm(self) -> None:
        if self._file is not None:
            faulthandler.cancel_dump_traceback_later()

    def close(self, remove_if_empty: bool = True) -> None:
        """Disarm, close the file and, when nothing was dumped, remove it (and its folder
        when that is left empty)."""
        if self._file is None:
            return
        self.disarm()
        self._file.close()
        self._file = None
        if not remove_if_empty:
            return
        try:
            if self.path.exists() and self.path.stat().st_size == 0:
                self.path.unlink()
            self.path.parent.rmdir()  # hangs/<id>/
            self.path.parent.parent.rmdir()  # hangs/
        except OSError:
            pass  # a folder holds other ranks' files or a report: leave it
