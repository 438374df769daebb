"""This rank's collective at a stall: ``CollectiveProbe.read`` makes the ``CollectiveRecord``
the watchdog publishes with its heartbeat once the local loop has stalled.

* **Flight recorder first** (``flight_recorder``): when torch records the guard's process
  group, the record holds the first pending collective (op, sequence id, input sizes) and
  the group's last few collectives. The full dump costs tens of milliseconds, so it is taken
  again only when the group's enqueued / completed ids changed (``pg_status``, ~10 us), and
  at most every ``min_dump_interval`` seconds; the record carries the last enqueued id
  of every read, so a window older than that is not taken for a rank that fell behind.
* **Else the main thread's stack** (``frames``): the op from the torch.distributed frame it
  waits in, or DDP's gradient all-reduce for a backward in a process with a DDP model.

Either way the label (``DDP's gradient all_reduce``) and the user's call site come from the
stack: the flight recorder knows the op, not who called it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from trainguard.hang import flight_recorder as fr
from trainguard.hang.collective_record import FLIGHT_RECORDER, STACK, Call, CollectiveRecord
from trainguard.hang.frames import Frame, StackCall, classify, ddp_in_process, main_thread_frames

logger = logging.getLogger(__name__)

DDP_RECHECK_S = 30.0
"""A process found without a DDP model is searched again after this long."""


class CollectiveProbe:
    """Reads this rank's ``CollectiveRecord`` (see the module docstring)."""

    def __init__(
        self,
        pg_name: str = "0",
        *,
        dump: fr.Dump | None = None,
        frames: Callable[[], list[Frame]] = main_thread_frames,
        ddp_present: Callable[[], bool] = ddp_in_process,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pg_name = pg_name
        self.min_dump_interval = 0.0
        """Seconds between two full dumps (the watchdog sets it from its timeout)."""
        self._dump = dump if dump is not None else fr.dump_function()
        self._frames = frames
        self._ddp_present = ddp_present
        self._clock = clock
        self._status: tuple[int, int] | None = None
        self._calls: list[Call] | None = None
        self._ddp: bool | None = None
        self._ddp_at = 0.0
        self._dumped_at = -float("inf")

    def read(self) -> CollectiveRecord:
        stack = classify(self._frames(), self._has_ddp)
        status = fr.pg_status(self.pg_name, self._dump) if self._dump is not None else None
        calls = self._recorded_calls(status) if status is not None else None
        if status is None or calls is None:
            return from_stack(stack, self._recorder_note())
        return from_recorder(stack, calls, enqueued=status[0])

    def _recorded_calls(self, status: tuple[int, int]) -> list[Call] | None:
        """The group's last calls: a new dump when the status changed since the last one
        (and the last one is ``min_dump_interval`` old), else the last dump's."""
        now = self._clock()
        stale = status != self._status or self._calls is None
        if stale and now - self._dumped_at >= self.min_dump_interval:
            self._calls = fr.read_calls(self.pg_name, self._dump)
            self._status, self._dumped_at = status, now
        return self._calls

    def _has_ddp(self) -> bool:
        now = self._clock()
        if self._ddp is None or (not self._ddp and now - self._ddp_at >= DDP_RECHECK_S):
            self._ddp = self._ddp_present()
            self._ddp_at = now
        return self._ddp

    def _recorder_note(self) -> str:
        if self._dump is None:
            return "this torch cannot dump its flight recorder"
        for name in (fr.BUFFER_ENV, fr.OLD_BUFFER_ENV):
            value = os.environ.get(name, "").strip()
            if value and value.lstrip("-").isdigit() and int(value) <= 0:
                return f"flight recorder off ({name}={value})"
        return f"flight recorder holds no collective of process group {self.pg_name!r}"


def from_stack(stack: StackCall, note: str = "") -> CollectiveRecord:
    site = stack.site
    return CollectiveRecord(
        STACK,
        stack.op,
        stack.label,
        file=site.file if site else "",
        line=site.line if site else 0,
        function=site.function if site else "",
        note=note,
    )


def from_recorder(
    stack: StackCall, calls: list[Call], enqueued: int | None = None
) -> CollectiveRecord:
    """The first pending call of the group is the one the rank waits in; the stack names it
    (DDP's, the guard's) when it agrees on the op."""
    pending = next((call for call in calls if not call.done), None)
    site = stack.site
    if pending is None:
        op, label, seq, sizes = None, stack.label if stack.op is None else "", None, None
    else:
        label = stack.label if stack.op == pending.op else pending.op
        op, seq, sizes = pending.op, pending.seq, pending.sizes
    return CollectiveRecord(
        FLIGHT_RECORDER,
        op,
        label,
        seq=seq,
        sizes=sizes,
        file=site.file if site else "",
        line=site.line if site else 0,
        function=site.function if site else "",
        last=list(calls),
        enqueued=enqueued,
    )
