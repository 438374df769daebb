"""The per-job folder a state at a failure is written to, and what it holds.

Default: ``/dev/shm/trainguard-<uid>/<job>`` where ``/dev/shm`` exists (memory: fast, kept
while the node is up, lost with it), else ``run_dir/failure-state``
(``recovery.failure_state_dir`` names another). ``<job>`` is a digest of the run folder's
resolved path: the same for every attempt of a job, another for another run. ``/dev/shm`` is
shared by every user of the node: both folders are made mode 0700 and used only when this user
owns them and nobody else may enter.

Files:

- ``mirror-rank-<r>.bin``: the rank's step-start record (``mirror.py``), rewritten each step;
- ``state-<step>-rank-<r>.pt`` and its ``.json``: a rank's state at a failure (``writer.py``);
  the JSON (size, SHA-256, the replicated part's digest) is written last, after the atomic
  rename of the ``.pt``: a state without it is incomplete and never read.

States are removed once a resume took them (or chose another), all of them when a new run
starts in the run folder (``resume=False``: ``forget``), and every file of the rank when its
run ends for good (closed without an exception, or stopped by the guard). A job
killed for good leaves its folder until a guard on the node starts: folders of other jobs
whose writers are all gone and that nothing touched for ``STALE_SECONDS`` are removed then.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SHM = Path("/dev/shm")
STALE_SECONDS = 600.0
"""A folder of another job untouched this long, its writers gone, is removed at start-up."""
_STATE = re.compile(r"^state-(\d{8})-rank-(\d+)(?:-by-(\d+))?\.json$")


def job_folder(run_dir: Path, configured: str | None) -> Path:
    """The job's folder (not created): see the module docstring."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    if configured:
        return Path(configured) / digest
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        return SHM / f"trainguard-{os.getuid()}" / digest
    return Path(run_dir) / "failure-state"


def _private(path: Path) -> bool:
    """``path`` is a folder this user owns that nobody else may enter."""
    info = path.lstat()
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
        and not info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    )


def open_folder(folder: Path) -> Path | None:
    """Create ``folder`` (and its parent) mode 0700; None, with a warning, when one exists
    and is another user's or open to others (never written into, never removed)."""
    try:
        folder.parent.parent.mkdir(parents=True, exist_ok=True)  # the user's own, as they are
    except OSError as exc:
        logger.warning("trainguard: no state at a failure: %s: %s", folder.parent.parent, exc)
        return None
    for path in (folder.parent, folder):
        try:
            path.mkdir(mode=0o700, exist_ok=True)
            if _private(path):
                continue
        except OSError as exc:
            logger.warning("trainguard: no state at a failure: %s: %s", path, exc)
            return None
        logger.warning(
            "trainguard: no state at a failure: %s is not a folder of this user's alone "
            "(mode 0700); remove it, or set recovery.failure_state_dir",
            path,
        )
        return None
    return folder


def fits(folder: Path, nbytes: int) -> bool:
    """Whether ``nbytes`` more fit in ``folder``'s file system (with a 5% and 16 MiB margin)."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return False
    return free > nbytes * 1.05 + (16 << 20)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def state_path(folder: Path, step: int, rank: int, writer: int | None = None) -> Path:
    """Rank ``rank``'s state at ``step``; ``writer``: another rank that holds a copy of it (a
    peer's snapshot shard, ``shards.py``)."""
    by = f"-by-{writer}" if writer is not None and writer != rank else ""
    return folder / f"state-{step:08d}-rank-{rank}{by}.pt"


def write_meta(path: Path, meta: dict[str, Any]) -> None:
    """The state's JSON beside it, atomically (written last: the state is complete)."""
    target = path.with_suffix(".json")
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(meta), encoding="utf-8")
    os.replace(tmp, target)


@dataclass(frozen=True)
class StateFile:
    """A complete state at a failure in the folder."""

    step: int
    rank: int
    """The rank whose state it is."""
    path: Path
    meta: dict[str, Any]
    writer: int = -1
    """The rank that wrote it (its own: ``rank``)."""

    def intact(self) -> bool:
        """Its size and SHA-256 are those written."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return False
        return size == self.meta.get("bytes") and sha256_of(self.path) == self.meta.get("sha256")


def states(folder: Path) -> list[StateFile]:
    """The complete states in ``folder``, newest step first."""
    found = []
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            match = _STATE.match(entry.name)
            if match is None:
                continue
            try:
                meta = json.loads(entry.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict):
                path = entry.with_suffix(".pt")
                owner = int(match[2])
                writer = int(match[3]) if match[3] is not None else owner
                found.append(StateFile(int(match[1]), owner, path, meta, writer))
    return sorted(found, key=lambda s: (-s.step, s.rank))


def remove_states(folder: Path, rank: int | None = None) -> None:
    """Remove the states (of ``rank`` only, when given) and unfinished writes."""
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            name = entry.name
            mine = rank is None or f"-rank-{rank}." in name or f"-by-{rank}." in name
            if name.startswith("state-") and mine:
                with contextlib.suppress(OSError):
                    entry.unlink()


def remove_rank(folder: Path, rank: int) -> None:
    """The run ended for good: this rank's files go, and the folder once empty."""
    remove_states(folder, rank)
    with contextlib.suppress(OSError):
        (folder / f"mirror-rank-{rank}.bin").unlink()
    remove_if_empty(folder)


def remove_if_empty(folder: Path) -> None:
    """The folder, and the user's folder above it, each only when empty: another rank's
    files, or a state kept for a resume, keep it."""
    for path in (folder, folder.parent):
        with contextlib.suppress(OSError):
            path.rmdir()


def sweep_stale(folder: Path, now: float | None = None) -> list[Path]:
    """Remove the folders of other jobs beside ``folder`` (same parent) that are stale: no
    writer alive (the pids in their mirrors) and nothing touched for ``STALE_SECONDS``."""
    now = time.time() if now is None else now
    removed = []
    with contextlib.suppress(OSError):
        for other in folder.parent.iterdir():
            if other == folder or not other.is_dir() or not _private(other):
                continue
            if _stale(other, now):
                shutil.rmtree(other, ignore_errors=True)
                removed.append(other)
    return removed


def _stale(folder: Path, now: float) -> bool:
    from trainguard.recovery.failure.mirror import writer_pid

    newest = folder.stat().st_mtime
    for entry in folder.iterdir():
        with contextlib.suppress(OSError):
            newest = max(newest, entry.stat().st_mtime)
            pid = writer_pid(entry) if entry.name.startswith("mirror-") else None
            if pid is not None and _alive(pid):
                return False
    return now - newest > STALE_SECONDS


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def forget(run_dir: Path, configured: str | None) -> bool:
    """A new run in ``run_dir`` (not a resume): the states and records an earlier run of it
    left are not this run's, and a later resume must not take them. Whether any were there."""
    folder = job_folder(run_dir, configured)
    try:
        if not _private(folder):
            return False
    except OSError:
        return False
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()
    return True
