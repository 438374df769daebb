"""The per-step metrics log: ``run_dir/metrics/rank-0.jsonl``.

One JSON line per recorded step: ``step``, ``losses`` (every rank's), ``grad_norm`` (global,
before clipping), ``decision``, ``lr``, ``step_seconds``, ``time`` and, when the guard times
the ranks (``detect_stragglers``), ``data_times`` and ``compute_times`` (every rank's
seconds waiting for data and in its own forward). Past 64 ranks ``losses`` is null and
``loss_summary`` holds ``min``, ``mean``, ``max`` and ``nonfinite_ranks``, and the times are
a ``time_summary`` (per phase: ``median``, ``max``, ``max_rank``) (``history.LOGGED_RANKS``),
so a line stays small at any scale.
The values are agreed across ranks, so rank 0 alone writes the file (the other ranks keep
only the in-memory ring).

Writes are batched: records are buffered as they are (their fields are built and each JSON
line encoded at the flush, in one tight loop, which costs a step less than building them
between two steps of training) and appended every ``flush_every`` lines or
``flush_seconds`` seconds (checked when a step is recorded), at once after a step that is not
``ok``, and on close. A process killed (a launcher's SIGTERM after another rank failed, which
no Python code sees while the main thread waits in a collective) loses the lines still
buffered: at most ``flush_every`` steps, or the last ``flush_seconds`` (1 s: a flush is a
file append, about 50-100 us, so a loop slower than 100 steps a second pays that once a
second and keeps all but its last second). The hang watchdog flushes before it ends the
process (``os._exit``). How far the process got survives any kill: the last step offered
is also stored in a memory-mapped mark (``runs/reached_mark.py``) that the report reads.

The size is bounded by thinning: every step is written up to ``dense_steps``, then every
10th step up to ``10 * dense_steps``, every 100th up to ``100 * dense_steps``, and so on
(about ``dense_steps`` lines per decade of steps), plus every step whose decision is not
``ok``. With the default 10,000, a run of a million steps writes about 30,000 lines.

A loop faster than ``max_lines_per_second`` steps a second is thinned by its rate as well,
past the first ``rate_free_steps`` steps the process records (a resumed run counts anew):
at each flush the rate of the steps offered since the previous measure sets a stride of 1,
2, 5, 10, 20, 50, ... (the smallest that keeps the lines under ``max_lines_per_second``),
and an ``ok`` step is written when its number is a multiple of the larger of that stride
and the decade's. A model whose step takes 10 ms or more (at the default 100 lines a
second) keeps every step; a small MLP at 3,000 steps a second writes every 50th, which
spares it formatting a line per step (some 4 us of host time hot, 5-8 us in the loop, where
the whole guard costs about 90 us: ``git show 3c1ebd7:docs/benchmarks.md``, "Round 8").
Every step not ``ok`` is written whatever the stride, and the in-memory ring (a bundle's
``history.json``) keeps every step.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from trainguard.events import to_jsonable
from trainguard.runs.reached_mark import ReachedMark

logger = logging.getLogger(__name__)

METRICS_DIR = "metrics"


def metrics_path(run_dir: Path | str) -> Path:
    """Where the metrics log of a run lives."""
    return Path(run_dir) / METRICS_DIR / "rank-0.jsonl"


def stride_at(step: int, dense_steps: int) -> int:
    """Write every ``stride_at(step)``-th step: 1 below ``dense_steps``, then x10 per decade."""
    stride, limit = 1, dense_steps
    while step >= limit:
        stride, limit = stride * 10, limit * 10
    return stride


def rate_stride(steps_per_second: float, max_lines_per_second: float) -> int:
    """The smallest stride of 1, 2, 5, 10, 20, 50, ... that keeps a loop of
    ``steps_per_second`` under ``max_lines_per_second`` lines a second."""
    stride, factors = 1, itertools.cycle((2.0, 2.5, 2.0))  # 1 -> 2 -> 5 -> 10 -> 20 ...
    while steps_per_second > max_lines_per_second * stride:
        stride = round(stride * next(factors))
    return stride


_ENCODER = json.JSONEncoder(allow_nan=False)
"""What ``json.dumps(..., allow_nan=False)`` builds at every call (a non-default option makes
it construct a new encoder each time), built once: the same text."""


def _line(fields: dict[str, Any]) -> str:
    """One JSON line: the C encoder straight away for the usual all-finite record, through
    ``to_jsonable`` (NaN/Inf as strings, paths) only when it refuses (the same text)."""
    try:
        return _ENCODER.encode(fields)
    except (ValueError, TypeError):
        return _ENCODER.encode(to_jsonable(fields))


def _text_of(record: LogRecord) -> str:
    line = record.log_line()
    return _line(record.log_fields()) if line is None else line


class LogRecord(Protocol):
    """What the log buffers: a step's record, turned into its line's fields at the flush."""

    @property
    def step(self) -> int: ...

    def log_fields(self) -> dict[str, Any]: ...

    def log_line(self) -> str | None:
        """The line ``_line(log_fields())`` gives, built faster, or None (then that)."""


class MetricsLog:
    """Buffered, thinned JSONL writer for the per-step records (rank 0 only); ``clock``:
    monotonic seconds (the flush timer and the loop's rate)."""

    def __init__(
        self,
        path: Path,
        *,
        flush_every: int = 100,
        flush_seconds: float = 1.0,
        dense_steps: int = 10_000,
        max_lines_per_second: float = 100.0,
        rate_free_steps: int = 1_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not max_lines_per_second > 0:
            raise ValueError(
                f"MetricsLog: max_lines_per_second must be > 0 (math.inf: every step), "
                f"got {max_lines_per_second!r}"
            )
        self.path = path
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        self.dense_steps = dense_steps
        self.max_lines_per_second = max_lines_per_second
        self.rate_free_steps = rate_free_steps
        self._lines: list[LogRecord] = []
        """The buffered records (their fields are built at the flush). Only ever appended to
        and cut from the front, never replaced: a flush on another thread
        (``flush_if_stale``) takes the records there were, an append meanwhile stays."""
        self._flush_lock = threading.Lock()
        """Flushes from two threads write one after the other, in order."""
        self._clock = clock
        self._last_flush = clock()
        self._failed = False
        self._offered = 0
        """Steps offered to ``add`` (kept or not)."""
        self._rate_mark = (self._last_flush, 0)
        """(monotonic time, ``_offered``) where the loop's rate is next measured from."""
        self.stride_by_rate = 1
        """The stride the loop's rate sets (``rate_stride``; 1 until measured)."""
        self._reached = ReachedMark(path.parent)
        """The last step offered, kept through a kill (``runs/reached_mark.py``)."""

    def wants(self, step: int, urgent: bool = False) -> bool:
        """Whether ``add`` would keep ``step`` (lets the caller skip building a thinned line)."""
        stride = self.stride_by_rate
        if step >= self.dense_steps:
            stride = max(stride, stride_at(step, self.dense_steps))
        return urgent or step % stride == 0

    def add(self, record: LogRecord, urgent: bool = False) -> None:
        """Buffer one step's record (``urgent``: a bad step, written out at once). The
        record's fields are read at the flush: it must not change after ``add``."""
        self._offered += 1
        self._reached.mark(record.step)
        if not self.wants(record.step, urgent):
            if self._offered - self._rate_mark[1] >= self.flush_every:
                self._measure_rate(self._clock())  # thinned: flushes are rarer
            return
        lines = self._lines
        lines.append(record)
        due = len(lines) >= self.flush_every
        if urgent or due or self._clock() - self._last_flush >= self.flush_seconds:
            self.flush()

    def _measure_rate(self, now: float) -> None:
        """Set ``stride_by_rate`` from the steps offered since the last measure (at least
        ``flush_every`` of them or a second's worth), past the first ``rate_free_steps``."""
        since, offered = self._rate_mark
        count, elapsed = self._offered - offered, max(now - since, 1e-9)
        if count < self.flush_every and elapsed < 1.0:
            return  # too few to tell (a flush at once after a bad step)
        self._rate_mark = (now, self._offered)
        if self._offered <= self.rate_free_steps or math.isinf(self.max_lines_per_second):
            return
        self.stride_by_rate = rate_stride(count / elapsed, self.max_lines_per_second)

    def flush_if_stale(self) -> None:
        """Flush when lines have waited ``flush_seconds`` (the hang watchdog's thread calls
        it every tick): a loop that stops adding (a long evaluation, a collective that never
        returns) then a kill loses at most that much of its log, not every line since its
        last flush."""
        if self._lines and self._clock() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Append the buffered lines to the file (never raises: the run goes on). Safe from
        another thread than ``add``'s (``flush_if_stale``)."""
        with self._flush_lock:
            self._flush()

    def _flush(self) -> None:
        self._last_flush = now = self._clock()
        self._measure_rate(now)
        lines = self._lines
        count = len(lines)
        if not count:
            return
        records = lines[:count]  # a slice and a del, each atomic: an append between them
        del lines[:count]  # (the loop's thread) lands after ``count`` and stays
        text = "".join([_text_of(record) + "\n" for record in records])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            if not self._failed:
                logger.error("trainguard: cannot write the metrics log %s: %s", self.path, exc)
            self._failed = True

    def close(self) -> None:
        self.flush()
        self._reached.close()
