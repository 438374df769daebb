"""torch's flight recorder: on where trainguard launches the workers, and read at a hang.

torch (2.13: gloo and NCCL) records every collective of a process group in a ring buffer
(``TORCH_FR_BUFFER_SIZE`` entries; the older name ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is read
too). The size is read once, when the first process group is created: setting it later has
no effect in that process.

* ``enable_by_default`` (on the environment of workers a trainguard launcher starts, e.g.
  ``trainguard demo``; never at import, which has no side effects): when neither variable
  is set, no process group exists yet and ``TRAINGUARD_FLIGHT_RECORDER`` is not ``0``, it
  sets ``TORCH_FR_BUFFER_SIZE=2000``. Elsewhere torch's default applies (torch 2.13 records
  2000 collectives; older releases may not record gloo): set the variable in the job's
  environment to be sure (``trainguard doctor`` says so).
* ``pg_status``: the group's enqueued / completed sequence ids, without the entries (about
  10 us): the watchdog re-reads the entries only when these changed.
* ``read_calls``: the last collectives of one process group as ``Call`` s (a full dump: tens
  of milliseconds for 2000 entries, so only when a rank has stalled).

The dump is torch's own pickle of its own buffer, made in this process
(``torch._C._distributed_c10d._dump_fr_trace``, and ``_dump_nccl_trace`` for NCCL's own
recorder); ``pickle.loads`` reads nothing from outside.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch.distributed as dist

from trainguard.hang.collective_record import Call

logger = logging.getLogger(__name__)

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
OLD_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
OPT_OUT_ENV = "TRAINGUARD_FLIGHT_RECORDER"
DEFAULT_ENTRIES = 2000
"""torch's own default in 2.13."""

LAST_CALLS = 4
"""Collectives of the group a rank publishes, and pending ones before them up to
``MAX_CALLS`` in all."""
MAX_CALLS = 16

Dump = Callable[..., bytes]


def enable_by_default(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``TORCH_FR_BUFFER_SIZE`` when nothing set it and no process group exists yet.
    Returns whether it did."""
    env = os.environ if environ is None else environ
    if env.get(OPT_OUT_ENV, "").strip() == "0":
        return False
    if BUFFER_ENV in env or OLD_BUFFER_ENV in env:
        return False
    if dist.is_available() and dist.is_initialized():
        return False
    env[BUFFER_ENV] = str(DEFAULT_ENTRIES)
    logger.debug("trainguard: %s=%d (torch's flight recorder)", BUFFER_ENV, DEFAULT_ENTRIES)
    return True


def setting(environ: Mapping[str, str] | None = None) -> str:
    """What this process's environment says: ``on`` (a size > 0), ``off`` (0), ``default``
    (unset: torch's default, 2000 in torch 2.13) or ``unavailable`` (no dump in this torch).
    The size in force is the one set when the first process group was created."""
    if dump_function() is None:
        return "unavailable"
    env = os.environ if environ is None else environ
    raw = env.get(BUFFER_ENV, env.get(OLD_BUFFER_ENV))
    if raw is None:
        return "default"
    try:
        return "on" if int(raw) > 0 else "off"
    except ValueError:
        return "default"


def dump_function() -> Dump | None:
    """torch's dump of the flight recorder (None: this torch has none that covers gloo).

    NCCL keeps its own recorder (CUDA events), dumped by ``_dump_nccl_trace`` in a build
    with NCCL; ``_dump_fr_trace`` dumps the one gloo records into (seen on torch 2.11 with
    one NCCL rank: ``_dump_fr_trace`` held none of its all-reduces). Where both exist, the
    dump reads both and merges them (``merged_dump``)."""
    if not dist.is_available():
        return None
    from torch._C import _distributed_c10d as c10d

    dump: Dump | None = getattr(c10d, "_dump_fr_trace", None)
    nccl: Dump | None = getattr(c10d, "_dump_nccl_trace", None)
    if dump is None or nccl is None:
        return dump
    return functools.partial(merged_dump, (dump, nccl))


def merged_dump(dumps: tuple[Dump, ...], **options: Any) -> bytes:
    """One pickle of several recorders' dumps: their entries (an entry both hold, once) and,
    per process group, the status that has seen the most collectives."""
    entries: list[dict[str, Any]] = []
    seen: set[tuple[str, int, str]] = set()
    status: dict[str, Any] = {}
    for dump in dumps:
        data = pickle.loads(dump(**options))
        for entry in data.get("entries", []):
            group: Any = entry.get("process_group") or ("",)
            key = (
                str(group[0]),
                int(entry.get("collective_seq_id", 0)),
                str(entry.get("profiling_name")),
            )
            if key not in seen:
                seen.add(key)
                entries.append(entry)
        for name, pg in data.get("pg_status", {}).items():
            known = status.get(name)
            if known is None or _enqueued(pg) > _enqueued(known):
                status[name] = pg
    return pickle.dumps({"entries": entries, "pg_status": status})


def _enqueued(status: Any) -> int:
    try:
        return int(status["last_enqueued_collective"])
    except (KeyError, TypeError, ValueError):
        return -1


def pg_status(pg_name: str, dump: Dump | None = None) -> tuple[int, int] | None:
    """(last enqueued, last completed) sequence ids of group ``pg_name``; None when the
    recorder is off, has no such group, or cannot be read."""
    dump = dump or dump_function()
    if dump is None:
        return None
    try:
        data = pickle.loads(dump(includeCollectives=False))
        status = data.get("pg_status", {}).get(pg_name)
        if not status:
            return None
        return int(status["last_enqueued_collective"]), int(status["last_completed_collective"])
    except Exception as exc:
        logger.debug("trainguard: flight recorder status not read: %s", exc)
        return None


def read_calls(pg_name: str, dump: Dump | None = None) -> list[Call] | None:
    """The last ``LAST_CALLS`` collectives of group ``pg_name`` (and every pending one
    before them), oldest first; None when the recorder is off or cannot be read."""
    dump = dump or dump_function()
    if dump is None:
        return None
    try:
        data = pickle.loads(dump(includeCollectives=True, includeStackTraces=False))
        entries = data.get("entries", [])
    except Exception as exc:
        logger.debug("trainguard: flight recorder not read: %s", exc)
        return None
    calls = sorted(
        (to_call(e) for e in entries if _in_group(e, pg_name) and not e.get("is_p2p")),
        key=lambda call: call.seq,
    )
    if not calls:
        return None
    return window(calls)


def window(calls: list[Call]) -> list[Call]:
    """The last ``LAST_CALLS`` calls, reaching back to the first pending one."""
    start = max(0, len(calls) - LAST_CALLS)
    pending = [i for i, call in enumerate(calls) if not call.done]
    if pending:
        start = max(min(start, pending[0]), len(calls) - MAX_CALLS)
    return calls[start:]


def to_call(entry: dict[str, Any]) -> Call:
    """One dump entry: ``profiling_name`` ``"gloo:all_reduce"`` -> op ``all_reduce``; an
    entry is done once torch retired it (gloo keeps ``state`` at ``scheduled``)."""
    name = str(entry.get("profiling_name", "?"))
    op = name.split(":", 1)[1] if ":" in name else name
    sizes = [[int(n) for n in shape] for shape in entry.get("input_sizes", [])]
    done = bool(entry.get("retired")) or entry.get("state") == "completed"
    return Call(int(entry.get("collective_seq_id", 0)), op, sizes, done)


def _in_group(entry: dict[str, Any], pg_name: str) -> bool:
    group: Any = entry.get("process_group") or ("",)
    return str(group[0]) == pg_name
