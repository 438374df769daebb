"""Each rank's step-start record, kept where its restart finds it: ``mirror-rank-<r>.bin``.

A rank killed outright (SIGKILL, the OOM killer, a segfault) writes nothing at its end; what
only it knew about the step in flight dies with it: its RNG states and data position at the
step's start. The weights and optimizer state of a data-parallel job a survivor holds, so
this small record is all its restart misses. It is rewritten at every step's start: the RNG
states' raw bytes (``RngSnapshot.parts``, pickled once per snapshot and copied only when
they moved), the step, epoch, data position and pid packed beside them, into one of two
slots of a memory-mapped file in turn (no system call; docs/recovery.md, "What it costs").
Each slot is framed by the same sequence number before and after its payload: a write cut
short leaves the two different and the slot is not read, the other slot still holds the step
before.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.capture.rng import RngSnapshot
from trainguard.recovery.failure.boundary import Boundary

_HEAD = struct.Struct("<QQqqqq?B")
"""sequence number, RNG part length, step, epoch, position, pid, stateful loader, moment"""
_TAIL = struct.Struct("<Q")  # the sequence number again
_AT = {"forward": 0, "handout": 1}
_AT_NAME = {code: name for name, code in _AT.items()}
SLOT = 64 << 10


def mirror_path(folder: Path, rank: int) -> Path:
    return folder / f"mirror-rank-{rank}.bin"


@dataclass(frozen=True)
class MirrorRecord:
    """A rank's step-start record as read back."""

    step: int
    epoch: int
    position: int
    pid: int
    stateful_loader: bool
    """The loader has a state of its own, which the record does not hold."""
    rng: tuple[Any, ...]
    """``RngSnapshot.parts()`` at the step's start."""
    at: str
    """``Boundary.at``: when ``rng`` was taken."""

    def rng_state(self) -> dict[str, Any]:
        return RngSnapshot.from_parts(self.rng).state()


class StepMirror:
    """Writes this rank's record at each step start (see the module docstring). The RNG part
    is pickled once per snapshot and copied into a slot only when that slot holds another."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = mirror_path(folder, rank)
        self._fd = -1
        self._slot = SLOT
        self._map: mmap.mmap | None = None
        """Opened at the first write: a restart reads the killed attempt's records first."""
        self._seq = 0
        self._pid = os.getpid()
        self._rng: tuple[RngSnapshot, bytes] | None = None
        """The last snapshot written and its pickled parts."""
        self._in_slot: list[bytes | None] = [None, None]
        """The RNG part each slot holds (identity: copied again only when another)."""

    def write(self, boundary: Boundary) -> None:
        rng = self._rng
        if rng is None or rng[0] is not boundary.rng:
            parts = pickle.dumps(boundary.rng.parts(), protocol=pickle.HIGHEST_PROTOCOL)
            rng = self._rng = (boundary.rng, parts)
        parts = rng[1]
        size = _HEAD.size + len(parts) + _TAIL.size
        if self._map is None:
            self._open(size)
        elif size > self._slot:
            self._grow(size)
        self._seq = seq = self._seq + 1
        turn = seq & 1
        offset = turn * self._slot
        mapped: Any = self._map
        _HEAD.pack_into(
            mapped,
            offset,
            seq,
            len(parts),
            boundary.step,
            boundary.epoch,
            boundary.position,
            self._pid,
            boundary.loader_state is not None,
            _AT[boundary.at],
        )
        start = offset + _HEAD.size
        end = start + len(parts)
        if self._in_slot[turn] is not parts:
            mapped[start:end] = parts
            self._in_slot[turn] = parts
        _TAIL.pack_into(mapped, end, seq)

    def _open(self, size: int) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._slot = max(size, self._slot)
        _reserve(self._fd, 2 * self._slot)
        self._map = mmap.mmap(self._fd, 2 * self._slot)

    def _grow(self, size: int) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        self._slot = max(size, 2 * self._slot)
        _reserve(self._fd, 2 * self._slot)
        self._map = mmap.mmap(self._fd, 2 * self._slot)
        self._in_slot = [None, None]

    def close(self) -> None:
        mapped, self._map = self._map, None
        with contextlib.suppress(OSError, ValueError):
            if mapped is not None:
                mapped.close()
            os.close(self._fd)


def _reserve(fd: int, size: int) -> None:
    """The file's ``size`` bytes, allocated now: a page of a mapped file that the file
    system cannot back when it is first written (a full /dev/shm) ends the process with
    SIGBUS; allocated up front, a full file system is an ``OSError`` here instead."""
    os.ftruncate(fd, size)
    if not hasattr(os, "posix_fallocate"):  # not Linux: the sparse file
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in _NO_FALLOCATE:
            raise


_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}
"""A file system that cannot allocate ahead: the file stays sparse, as before."""


def read_mirror(path: Path) -> list[MirrorRecord]:
    """The intact records of a mirror file, newest first (none: no file, or both torn)."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    records = []
    half = len(data) // 2
    for offset in (0, half):
        record = _slot_record(data, offset, half)
        if record is not None:
            records.append(record)
    return [r for _, r in sorted(records, key=lambda pair: -pair[0])]


def _slot_record(data: bytes, offset: int, slot: int) -> tuple[int, MirrorRecord] | None:
    if slot < _HEAD.size + _TAIL.size:
        return None
    seq, rng_len, step, epoch, position, pid, loader, at = _HEAD.unpack_from(data, offset)
    start = offset + _HEAD.size
    end = start + rng_len
    if seq == 0 or end + _TAIL.size > offset + slot or at not in _AT_NAME:
        return None
    if _TAIL.unpack_from(data, end)[0] != seq:
        return None
    try:
        rng = pickle.loads(data[start:end])
    except Exception:  # a torn or foreign payload: not a record
        return None
    record = MirrorRecord(step, epoch, position, pid, bool(loader), tuple(rng), _AT_NAME[at])
    return seq, record


def writer_pid(path: Path) -> int | None:
    """The pid that wrote a mirror file's newest record (None: unreadable)."""
    records = read_mirror(path)
    return records[0].pid if records else None
