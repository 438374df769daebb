"""``trainguard run [OPTIONS] -- COMMAND...``: run an unmodified script with the guard attached.

The command runs as a child process in an environment that attaches the guard
(``options.child_env``); this process only waits for it, passes on SIGINT/SIGTERM/SIGHUP,
and returns its exit status. Under torchrun the agent reports a worker's failure as its own
status 1, so when the guard ended the workers (a hang: 91, a peer failure: 92) and wrote a
report under ``run_dir/hangs/`` during this run, that report's code is returned instead. Not
for a peer failure that a rank's own exception caused (the rank published it: the report's
culprit decided it): that is the script's error, and the command's status (1) stands, as
torchrun names the failing rank the root cause.

``Finished.attached`` says whether a guard wrote events under ``run_dir/events`` during the
run. None did when no process attached (``python -I``, a launcher that resets
``PYTHONPATH``, a script that ends before its first optimizer step) or each stood aside
before building a guard (the script has its own: said on stderr then); the CLI says so in
one line, rather than let an unguarded run pass for a guarded one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from trainguard.attach.options import RunOptions, child_env, launcher_of
from trainguard.attach.status import unguarded_reasons
from trainguard.errors import ConfigError

logger = logging.getLogger(__name__)

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

MTIME_SLACK_S = 2.0
"""A file system may store modification times coarsely (2 s on FAT): an events file written
in the run's first moments can look older than its start by that much."""


@dataclass(frozen=True)
class Finished:
    """How ``COMMAND`` ended under ``trainguard run``."""

    code: int
    """The exit status to return: the command's, or the guard's (the module docstring)."""
    attached: bool
    """Whether a process of the command wrote guard events during the run."""
    reasons: list[str] = dataclasses.field(default_factory=list)
    """Why processes were not guarded, as they said (``status.unguarded_reasons``)."""
    own_guard: bool = False
    """Every process that said why stood aside for the script's own guard."""


def run_command(command: Sequence[str], options: RunOptions) -> Finished:
    """Run ``command`` with the guard attached; its exit status (or the guard's, above)."""
    if not command:
        raise ConfigError("COMMAND", "nothing to run; use: trainguard run [OPTIONS] -- COMMAND...")
    run_dir = usable_run_dir(Path(options.run_dir).resolve())
    options = dataclasses.replace(options, run_dir=str(run_dir), launcher=launcher_of(command))
    started = time.time()
    try:
        child = subprocess.Popen(list(command), env=child_env(options))
    except OSError as exc:
        raise ConfigError(
            "COMMAND", f"cannot start {command[0]!r}: {exc.strerror or exc}"
        ) from None
    previous = {sig: signal.signal(sig, _forward_to(child)) for sig in _FORWARDED}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    attached = attached_since(run_dir, started)
    reasons, own_guard = ([], False) if attached else unguarded_reasons(run_dir, started)
    return Finished(_exit_status(code, run_dir, started), attached, reasons, own_guard)


def _exit_status(code: int, run_dir: Path, started: float) -> int:
    if code < 0:  # killed by a signal: the shell's convention
        return 128 - code
    if code != 0:
        return guard_exit_code(run_dir, started) or code
    return code


def usable_run_dir(run_dir: Path) -> Path:
    """``run_dir``, made if missing; a ``ConfigError`` naming ``--run-dir`` when it cannot be
    written, before the command starts (else every rank would stand aside at its first step
    and the job would run unguarded)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            "--run-dir",
            f"cannot use {str(run_dir)!r}: {exc.strerror or exc}; pick a folder "
            "this user can create and write",
        ) from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError("--run-dir", f"{str(run_dir)!r} is not writable; pick another folder")
    return run_dir


def _forward_to(child: subprocess.Popen[bytes]) -> Callable[[int, FrameType | None], None]:
    def forward(signum: int, frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    return forward


def guard_exit_code(run_dir: Path, since: float) -> int | None:
    """The exit code of the newest hang or peer-failure report written since ``since``, but
    for one a rank's own exception caused (``raised_by_culprit``)."""
    newest: tuple[float, int] | None = None
    for report in run_dir.glob("hangs/*/report.json"):
        try:
            mtime = report.stat().st_mtime
            if mtime < since:
                continue
            data = json.loads(report.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or raised_by_culprit(data):
            continue
        code = data.get("exit_code")
        if not isinstance(code, int):
            continue
        if newest is None or mtime > newest[0]:
            newest = (mtime, code)
    return newest[1] if newest is not None else None


def raised_by_culprit(report: dict[str, object]) -> bool:
    """A peer failure the failing rank published itself (its exception), not a rank that
    died, froze or left without a word (``rules.own_failure``: imported here, after the
    command, so that ``trainguard run`` starts without torch)."""
    from trainguard.hang.rules import own_failure

    return own_failure(report.get("kind"), report.get("culprits"), report.get("decided_by"))


def attached_since(run_dir: Path, since: float) -> bool:
    """Whether any rank wrote guard events under ``run_dir`` since ``since``."""
    for path in run_dir.glob("events/rank-*.jsonl"):
        try:
            if path.stat().st_mtime >= since - MTIME_SLACK_S:
                return True
        except OSError:
            continue
    return False
