"""``trainguard run [OPTIONS] -- COMMAND...``: run an unmodified script with the guard attached.

The command runs as a child process in an environment that attaches the guard
(``options.child_env``); this process only waits for it, passes on SIGINT/SIGTERM/SIGHUP,
and returns its exit status. Under torchrun the agent reports a worker's failure as its own
status 1, so when the guard ended the workers (a hang: 91, a peer failure: 92) and wrote a
report under ``run_dir/hangs/`` during this run, that report's code is returned instead.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from trainguard.attach.options import RunOptions, child_env, launcher_of
from trainguard.errors import ConfigError

logger = logging.getLogger(__name__)

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_command(command: Sequence[str], options: RunOptions) -> int:
    """Run ``command`` with the guard attached; its exit status (or the guard's, above)."""
    if not command:
        raise ConfigError("COMMAND", "nothing to run; use: trainguard run [OPTIONS] -- COMMAND...")
    run_dir = usable_run_dir(Path(options.run_dir).resolve())
    options = RunOptions(
        run_dir=str(run_dir),
        on_nonfinite=options.on_nonfinite,
        hang_timeout=options.hang_timeout,
        capture=options.capture,
        launcher=launcher_of(command),
    )
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
    """The exit code of the newest hang or peer-failure report written since ``since``."""
    newest: tuple[float, int] | None = None
    for report in run_dir.glob("hangs/*/report.json"):
        try:
            mtime = report.stat().st_mtime
            if mtime < since:
                continue
            code = json.loads(report.read_text()).get("exit_code")
        except (OSError, ValueError):
            continue
        if isinstance(code, int) and (newest is None or mtime > newest[0]):
            newest = (mtime, code)
    return newest[1] if newest is not None else None
