"""Why a process of ``trainguard run`` is not guarded, left for the command's last word.

A process that stood aside, or trained without ever reaching an optimizer step, says why on
its stderr at once; it also leaves the reason in ``run_dir/attach/``, one small JSON file a
process, so that ``trainguard run`` ends an unguarded run with the real reason
(``unguarded_reasons``) instead of a list of guesses. Where no process left one, none
installed the hooks: the bootstrap did not run (``python -I``/``-E``/``-S``, a launcher
that resets ``PYTHONPATH``) or no process imported torch.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

FOLDER = "attach"


def write_reason(run_dir: Path | str, rank: int, reason: str, guarded: bool = False) -> None:
    """Leave this process's reason (atomic: a temporary file, then a rename). ``guarded``: the
    script's own guard keeps the run. Best effort: a run dir that cannot be written loses
    only this note."""
    folder = Path(run_dir) / FOLDER
    name = f"{socket.gethostname()}-{os.getpid()}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{name}.tmp"
        tmp.write_text(json.dumps({"rank": rank, "reason": reason, "guarded": guarded}))
        os.replace(tmp, folder / name)
    except OSError:
        pass


def unguarded_reasons(run_dir: Path | str, since: float) -> tuple[list[str], bool]:
    """The distinct reasons processes left since ``since``, in the order of their ranks, and
    whether every such process's script kept its own guard."""
    found: list[tuple[int, str]] = []
    own = True
    for path in Path(run_dir, FOLDER).glob("*.json"):
        try:
            if path.stat().st_mtime < since - 2.0:  # a coarse clock: launch.MTIME_SLACK_S
                continue
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("reason"), str):
            rank = data.get("rank")
            found.append((rank if isinstance(rank, int) else 0, data["reason"]))
            own = own and data.get("guarded") is True
    reasons: list[str] = []
    for _, reason in sorted(found):
        if reason not in reasons:
            reasons.append(reason)
    return reasons, own and bool(reasons)


def unguarded_line(run_dir: str, reasons: list[str], own_guard: bool) -> str:
    """The last word of a run trainguard run did not guard: the script's own guard kept it,
    the reasons the processes left, or, where none left one, that none installed the hooks."""
    if own_guard:
        return f"trainguard run: not attached: the script's own guard kept the run ({reasons[0]})"
    if reasons:
        return f"trainguard run: the run was not guarded: {'; '.join(reasons)}"
    return (
        f"trainguard run: the run was not guarded (no guard events in {run_dir}): no process "
        "of the command imported torch with trainguard's bootstrap on its path (python -I, "
        "-E or -S, or a launcher that resets PYTHONPATH: docs/run.md), or none ran a "
        "training step"
    )
