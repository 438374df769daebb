"""Failures of this rank, published from the main thread so the other ranks exit now.

A rank going down with an exception (``Guard.__exit__``, or an exception that escapes a
plain ``for batch in guard.watch(...)`` loop through the chained ``sys.excepthook``)
proposes a ``peer_failure`` verdict naming itself; the others' watchdogs read it at their
next tick and act on it (``exit_path``). This is the only time the main thread touches the
store, over its own connection (``main_channel``).

When several ranks fail at once (the same bug everywhere), the first verdict stands and
names its rank; each other failing rank logs its own exception with its traceback and
writes a ``failed_too`` event (then exits with the others), so no rank's error is lost.

Not published: exceptions raised on every rank by design (``NonFiniteError``) and
``PeerFailureError``. An error from a collective or the store is likely a symptom of
another rank's death: the watchdog first gets the chance to find that rank (and to end the
process with ``EXIT_PEER_FAILURE``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from trainguard.events import EventLog
from trainguard.hang.channel import StoreChannel
from trainguard.hang.exit_path import SAFETY_EXIT_S, attempt
from trainguard.hang.frames import classify, ddp_in_process, frames_of_traceback
from trainguard.hang.progress import Progress
from trainguard.hang.rules import (
    Verdict,
    failure_verdict,
    is_comm_error,
    left_verdict,
    should_publish,
)

logger = logging.getLogger(__name__)

ExcHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


class FailurePublisher:
    """Tells the other ranks that this one failed (see the module docstring).

    ``await_exit(timeout)`` waits until the watchdog thread acts on a verdict (it then ends
    the process) and says whether it did; ``comm_grace()`` is how long to give it to find a
    dead peer behind a communication error."""

    def __init__(
        self,
        *,
        channel: StoreChannel,
        progress: Progress,
        events: EventLog,
        exiting: threading.Event,
        ack_wait_s: float,
        await_exit: Callable[[float], bool],
        comm_grace: Callable[[], float],
    ) -> None:
        self.channel = channel
        self.rank = channel.rank
        self.members = list(channel.members)
        self.progress = progress
        self.events = events
        self.failed = False
        """This rank published its own failure (its final heartbeat says ``failed``)."""
        self.closed = False
        self.comm_error: str | None = None
        """This rank's collective that failed under it, where and how (the stack dump's
        header says it: the dump itself shows only the failure handling)."""
        self._exiting = exiting
        self._ack_wait = ack_wait_s
        self._await_exit = await_exit
        self._comm_grace = comm_grace
        self._previous_hook: ExcHook | None = None

    def close(self) -> None:
        """Publish nothing from now on (the watchdog stopped)."""
        self.closed = True

    def publish(self, exc: BaseException, printed: bool = False) -> None:
        """This rank is going down with ``exc``: tell the other ranks so they exit now.
        ``printed``: its traceback was printed already (the excepthook)."""
        if self.closed or not should_publish(exc):
            return
        if is_comm_error(exc):  # first: a launcher's SIGTERM may come at any moment now
            self._record_comm_error(exc)
        if self._exiting.is_set() or self._verdict_published():
            self._failed_too(exc, printed)
            self._await_exit(SAFETY_EXIT_S)
            return
        if is_comm_error(exc):
            left = self._peers_that_left()
            if left:  # their guard closed mid-run: they are why the collective broke
                self._publish_verdict(left_verdict(self.rank, left, exc))
                return
            if self._await_exit(self._comm_grace()):
                return
        self.failed = True
        mine = failure_verdict(self.rank, self.members, exc)
        try:
            held = self.channel.propose(mine)
        except Exception as err:
            logger.warning("trainguard: could not publish this rank's failure: %s", err)
            return
        if held != mine:  # another rank's verdict came first: act on it
            self.failed = False
            self._failed_too(exc, printed)
            self._await_exit(SAFETY_EXIT_S)
            return
        self.events.write("failure_published", self.progress.step, reason=mine.reason)
        self._await_dumps(len(self.members) - 1)

    def _failed_too(self, exc: BaseException, printed: bool) -> None:
        """This rank failed on its own while another rank's failure (or a hang) ends the
        job: its exception is not the verdict's, but it is not lost either (logged with its
        traceback, and a ``failed_too`` event the report lists). A collective's error then
        is a symptom of the other rank's failure: not news."""
        if is_comm_error(exc):
            return
        reason = f"rank {self.rank} failed too: {type(exc).__name__}: {exc}"[:2000]
        logger.error("trainguard: %s", reason, exc_info=None if printed else exc)
        with contextlib.suppress(Exception):  # the log may be closing: the traceback counts
            self.events.write("failed_too", self.progress.step, reason=reason)

    def _record_comm_error(self, exc: BaseException) -> None:
        """A ``comm_error`` event: the collective that broke and the loop's line that called
        it, written before this rank waits for the watchdog (a launcher may end it with
        SIGTERM meanwhile: the signal's stack dump then shows only the wait)."""
        call = classify(frames_of_traceback(exc.__traceback__), ddp_in_process)
        site = f"{call.site.file}:{call.site.line}" if call.site is not None else None
        error = f"{type(exc).__name__}: {exc}"
        at = f" at {site}" if site else ""
        self.comm_error = f"{call.label or 'a collective'}{at}: {error}"
        with contextlib.suppress(Exception):  # the log may be closing
            self.events.write(
                "comm_error",
                self.progress.step,
                error=error[:500],
                call=call.label or None,
                site=site,
            )

    def _peers_that_left(self) -> list[int]:
        """Peers whose guard closed (``sys.exit``, Ctrl-C, an exception the guard did not
        see) while this rank still trains: their heartbeats say ``closed``."""
        read = attempt(self.channel.read)
        if read is None:
            return []
        beats, _ = read
        return sorted(
            rank
            for rank, beat in beats.items()
            if rank != self.rank and beat is not None and beat.state == "closed"
        )

    def _publish_verdict(self, verdict: Verdict) -> None:
        """Propose ``verdict`` (or find another rank's first) and let the watchdog act on it."""
        try:
            self.channel.propose(verdict)
        except Exception as err:
            logger.warning("trainguard: could not publish the verdict: %s", err)
            return
        self._await_exit(SAFETY_EXIT_S)

    def _verdict_published(self) -> bool:
        try:
            return self.channel.read_verdict() is not None
        except Exception:
            return False

    def _await_dumps(self, expected: int) -> None:
        """Wait (briefly) until the other ranks have read the verdict and dumped their stacks
        before this process goes on to end: the rank serving the store must not take it away
        before they read it, and under torchrun this process's exit makes the agent end the
        others (which wait for it: ``ExitPath._await_failed_processes``), so they must have
        dumped and written their report by then."""
        deadline = time.monotonic() + self._ack_wait
        while time.monotonic() < deadline:
            count = attempt(self.channel.dumps)
            if count is None or count >= expected:
                return
            time.sleep(0.05)

    # -- the chained sys.excepthook ---------------------------------------------------------

    def install_hook(self) -> None:
        self._previous_hook = sys.excepthook
        sys.excepthook = self.excepthook

    def uninstall_hook(self) -> None:
        """Put the previous hook back, unless another one was chained after this one."""
        if sys.excepthook == self.excepthook and self._previous_hook is not None:
            sys.excepthook = self._previous_hook

    def excepthook(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        """Publish an exception that escaped a plain ``for batch in guard.watch(...)`` loop.
        A collective's error while the watchdog ends the process (or finds a dead peer) is
        a symptom: its traceback is printed only if the process is still alive after that."""
        previous = self._previous_hook or sys.__excepthook__
        symptom = is_comm_error(exc) or self._exiting.is_set()
        if not symptom:
            previous(exc_type, exc, tb)
        try:
            self.publish(exc, printed=not symptom)
        finally:
            if symptom:
                previous(exc_type, exc, tb)
