"""How far a killed process got: rank 0's last recorded step, in a memory-mapped file.

The metrics log is batched (``metrics_log.py``): a process killed by SIGKILL loses the lines
still buffered, up to its last second, and ``trainguard report`` then undercounts the steps
that start ran (and so the steps its restart ran twice). So at every step ``add``ed to the
log, ``ReachedMark.mark`` stores the step and the wall time into a 28-byte shared mapping of
``metrics/reached-<ns>-<pid>.bin``: a memory store, no system call (about 0.5 us). The
kernel keeps a shared mapping's pages when the process dies, however it dies, so the file
holds the last step recorded. One file per process (a restart writes its own); the report
reads each as one more metrics point (``read_marks``: its step and time) when it counts
how far each start got. A torn store (the process killed inside it) fails the check word
and is ignored.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = b"TGR1"
_LAYOUT = struct.Struct("<4sqdq")
"""Magic, step, wall time, check word (``_check``)."""
PATTERN = "reached-*.bin"


def _check(step: int, when: float) -> int:
    return step ^ int(when * 1e6) ^ 0x5BD1E995


class ReachedMark:
    """Rank 0's last recorded step, kept through a kill (see the module's text)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._map: mmap.mmap | None = None
        self._failed = False

    def mark(self, step: int) -> None:
        """Store ``step`` as the last one recorded (never raises)."""
        mapped = self._map
        if mapped is None:
            if self._failed:
                return
            mapped = self._open()
            if mapped is None:
                return
        when = time.time()
        _LAYOUT.pack_into(mapped, 0, MAGIC, step, when, _check(step, when))

    def _open(self) -> mmap.mmap | None:
        path = self.folder / f"reached-{time.time_ns()}-{os.getpid()}.bin"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.ftruncate(fd, _LAYOUT.size)
                self._map = mmap.mmap(fd, _LAYOUT.size)
            finally:
                os.close(fd)  # the mapping keeps the file
        except OSError as exc:
            logger.debug("trainguard: no reached mark at %s: %s", path, exc)
            self._failed = True
        return self._map

    def close(self) -> None:
        """Unmap the file; a later ``mark`` writes nothing (it would open a new file)."""
        self._failed = True
        mapped, self._map = self._map, None
        if mapped is not None:
            mapped.close()


def read_marks(folder: Path) -> list[dict[str, Any]]:
    """Each readable mark under ``folder`` as a metrics point: ``{"step", "time"}``."""
    found = []
    for path in sorted(folder.glob(PATTERN)):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if len(data) != _LAYOUT.size:
            continue
        magic, step, when, check = _LAYOUT.unpack(data)
        if magic == MAGIC and check == _check(step, when):
            found.append({"step": step, "time": when})
    return found
