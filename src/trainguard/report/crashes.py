"""Ranks that a signal ended: the stacks faulthandler wrote (``hang/signal_dump.py``).

``run_dir/hangs/<id>/rank-<r>.signal.txt`` starts with ``Fatal Python error: <what>`` for
a fatal signal, and with a thread's stack for ``SIGTERM``. Each thread's block is
``Thread 0x... (most recent call first):`` (``Current thread`` for the one the signal
interrupted) and one ``  File "<path>", line <n> in <function>`` per frame, innermost first.
The main thread is the block whose outermost frame is not ``threading``'s bootstrap; what it
was doing is read as a hang's stack is (``hang/frames.py``: the collective it was in, the
loop's line that called it). A rank that saw a collective fail first (a ``comm_error``
event) was waiting in trainguard's failure handling when the signal came: its line is the
one the event names.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from trainguard.hang.frames import TORCH_DIR, TRAINGUARD_DIR, Frame, classify
from trainguard.report.readers import Skipped, int_of

_FATAL = {
    "Aborted": "SIGABRT",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Floating-point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
"""faulthandler's names of the fatal signals."""

_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+ .*:$")
_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')
_NAME = re.compile(r"^rank-(?P<rank>\d+)\.signal\.txt$")
_INSTALLED = re.compile(r"^.*[/\\](?:site|dist)-packages[/\\](?P<package>torch|trainguard)[/\\]")
"""torch or trainguard installed elsewhere (the crashed job's environment, not this one)."""

_HINTS = {
    "SIGTERM": "the launcher ends the other ranks when one fails; a scheduler stops or "
    "preempts a job",
    "SIGABRT": "in a collective: it failed, or did not match the peers' (gloo aborts on a "
    "size mismatch, NCCL on its watchdog's timeout)",
}


def read_crashes(root: Path, skipped: Skipped) -> list[dict[str, Any]]:
    """One record per non-empty signal file: ``rank``, ``signal``, ``call`` (the collective
    or op the main thread was in), ``site`` (the loop's line), ``time`` and ``path``."""
    crashes = []
    for path in sorted((root / "hangs").glob("*/rank-*.signal.txt")):
        match = _NAME.match(path.name)
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
            mtime = path.stat().st_mtime
        except OSError:
            skipped.add_file(str(path.relative_to(root)), "unreadable")
            continue
        if not text.strip() or match is None:
            continue
        crashes.append(
            {"rank": int(match["rank"]), "time": mtime, "path": str(path.relative_to(root))}
            | parse_signal_dump(text)
        )
    return crashes


def parse_signal_dump(text: str) -> dict[str, Any]:
    """``signal``, ``call`` and ``site`` (``file:line``) of one signal file's text."""
    first = text.lstrip().splitlines()[0] if text.strip() else ""
    fatal = first.removeprefix("Fatal Python error: ").strip()
    signal = _FATAL.get(fatal, fatal) if first.startswith("Fatal Python error:") else "SIGTERM"
    frames = _main_thread(text)
    call = classify(frames, lambda: False)
    site = call.site
    return {
        "signal": signal,
        "call": call.label or None,
        "collective": call.op is not None,
        "site": f"{site.file}:{site.line}" if site is not None else None,
        "in_failure_handling": any(_failure_handling(f) for f in frames),
    }


def with_comm_errors(
    crashes: list[dict[str, Any]], events: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each crash of a rank that saw a collective fail before: that collective's ``call``
    and ``site`` (the signal found it in trainguard's failure handling), with ``error``."""
    errors = {int_of(e.get("rank")): e for e in events if e.get("kind") == "comm_error"}
    out = []
    for crash in crashes:
        error = errors.get(crash["rank"])
        if error is not None and crash.get("in_failure_handling"):
            crash = crash | {
                "call": error.get("call"),
                "site": error.get("site"),
                "error": error.get("error"),
                "step": error.get("step"),
            }
        out.append(crash)
    return out


def crash_line(crash: dict[str, Any]) -> str:
    """One report line: the rank, the signal, where, the hint and the stack file."""
    line = f"rank {crash.get('rank')}: {crash.get('signal')}"
    if crash.get("error"):
        line += f" after its {crash.get('call') or 'collective'} failed"
        line += f" at {crash['site']}" if crash.get("site") else ""
        line += f" (step {crash['step']})" if crash.get("step") is not None else ""
    elif crash.get("in_failure_handling"):
        at = f" (the block at {crash['site']})" if crash.get("site") else ""
        line += f" while its guard handled the exception that ended the loop{at}"
    elif crash.get("call"):
        line += f" in {crash['call']}"
        line += f", called from {crash['site']}" if crash.get("site") else ""
    elif crash.get("site"):
        line += f" at {crash['site']}"
    hint = _HINTS.get(str(crash.get("signal")))
    if hint and (crash.get("signal") == "SIGTERM" or crash.get("collective")):
        line += f" [{hint}]"
    return line + f"; stacks {crash.get('path')}"


def _main_thread(text: str) -> list[Frame]:
    """The main thread's frames, outermost first (empty when none is found)."""
    threads: list[list[Frame]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
            continue
        frame = _FRAME.match(line)
        if frame is not None and threads:
            file = _as_here(frame["file"])
            threads[-1].append(Frame(file, int(frame["line"]), frame["function"]))
    for frames in threads:
        if frames and frames[-1].function not in ("_bootstrap", "_bootstrap_inner"):
            return list(reversed(frames))
    return []


def _as_here(file: str) -> str:
    """A file of torch or trainguard installed in another environment, as the same file of
    this one's (so ``classify`` knows it for library code)."""
    installed = _INSTALLED.match(file)
    if installed is None:
        return file
    home = TORCH_DIR if installed["package"] == "torch" else TRAINGUARD_DIR
    return home + file[installed.end() :]


def _failure_handling(frame: Frame) -> bool:
    """A frame of trainguard handling an exception that ends this rank: publishing it
    (``hang/failure.py``) or the guard's ``__exit__``."""
    if frame.file.endswith(("hang/failure.py", "hang\\failure.py")):
        return True
    guard = frame.file.endswith(("step/guard.py", "step\\guard.py"))
    return guard and frame.function == "__exit__"
