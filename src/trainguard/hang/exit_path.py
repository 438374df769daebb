"""Acting on a verdict: the way every live rank ends once a hang or a dead peer is decided.

``ExitPath.act`` runs once per process, on the watchdog thread. In order, it

1. starts a safety timer (``SAFETY_EXIT_S``) that exits even if a step below hangs, and
   disarms the faulthandler fallback (``stacks.FrozenDump``),
2. acknowledges the verdict in the store (``ack``), so the rank serving the store knows it
   was read,
   and ends with SIGKILL the frozen culprits on this host (``frozen.py``): a stopped
   process that no launcher's SIGTERM can end would keep the job waiting,
3. dumps this process's stacks to ``run_dir/hangs/<id>/rank-<r>.txt`` and counts the dump
   in the store (``dumped``),
4. writes ``report.json`` when this rank is the verdict's reporter, and a ``hang`` /
   ``peer_failure`` event,
5. waits (at most ``ACK_WAIT_S``) until every live rank has dumped: the first rank to exit
   makes torchrun terminate the others, which must not cut a dump short,
6. flushes the event log, the logging handlers and stdout/stderr,
7. after a failure the failing rank published itself, waits (at most ``FAILED_EXIT_WAIT_S``)
   until the failing processes on this host have ended, so that torchrun sees their own
   exit first (``_await_failed_processes``),
8. ends the process with ``os._exit(EXIT_HANG)`` or ``os._exit(EXIT_PEER_FAILURE)``: the
   main thread may be blocked in a collective forever, so exiting the process is the only
   way out.

An ``offline`` verdict (the store itself stopped answering) skips the store's counters.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainguard.events import EventLog
from trainguard.exitcodes import EXIT_HANG, EXIT_PEER_FAILURE
from trainguard.hang.channel import StoreChannel
from trainguard.hang.collective_record import CollectiveRecord, describe
from trainguard.hang.frozen import (
    REPORTER_FIRST_S,
    end,
    frozen_ranks,
    gone_within,
    process_state,
    still_frozen,
    write_note,
)
from trainguard.hang.progress import Progress
from trainguard.hang.report import stack_file, write_report
from trainguard.hang.rules import HANG, PEER_FAILURE, Verdict, own_failure
from trainguard.hang.signal_dump import SignalDump
from trainguard.hang.stacks import FrozenDump, write_stack_dump

logger = logging.getLogger(__name__)

ACK_WAIT_S = 5.0
"""How long a rank waits for the others to read a verdict, or to dump their stacks."""

FAILED_EXIT_WAIT_S = 5.0
"""How long a rank waits for a failed rank's process on its host to end before it exits."""
FAILED_EXIT_GRACE_S = 1.5
"""... and then, for the launcher to see that exit first (``_await_failed_processes``)."""

SAFETY_EXIT_S = 30.0
"""A rank acting on a verdict exits after this long even if dumping or writing hangs."""

ReportBuilder = Callable[[Verdict, int], dict[str, Any]]
"""Builds ``report.json`` for a verdict and its exit code (the watchdog knows the views)."""


def exit_code_for(kind: str) -> int:
    return EXIT_HANG if kind == HANG else EXIT_PEER_FAILURE


def attempt(action: Callable[[], Any]) -> Any:
    """Run ``action``; on an exception log a warning and return None. On the way out nothing
    may stop the process from exiting."""
    try:
        return action()
    except Exception as exc:
        logger.warning("trainguard watchdog: %s", exc)
        return None


class ExitPath:
    """One rank's way out once a verdict holds (see the module docstring).

    ``hang_id`` (the run's id, agreed in the store) and ``fallback`` (the faulthandler
    fallback, when armed) are set by the watchdog when it starts."""

    def __init__(
        self,
        *,
        channel: StoreChannel,
        progress: Progress,
        events: EventLog,
        run_dir: Path,
        build_report: ReportBuilder,
        store_host: int | None,
        exit_fn: Callable[[int], Any],
        ack_wait_s: float,
    ) -> None:
        self.channel = channel
        self.rank = channel.rank
        self.members = list(channel.members)
        self.progress = progress
        self.events = events
        self.run_dir = Path(run_dir)
        self.store_host = store_host
        self.hang_id = ""
        self.fallback: FrozenDump | None = None
        self.signals: SignalDump | None = None
        """The fatal-signal and SIGTERM stack dump, dropped when this path ends the process."""
        self.verdict: Verdict | None = None
        self.exiting = threading.Event()
        """Set once this process has started acting on a verdict."""
        self._build_report = build_report
        self._exit_fn = exit_fn
        self._ack_wait = ack_wait_s
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self.collective: dict[str, Any] | None = None
        """The collective this rank waits in (its latest record), for the stack dump."""
        self.own_dump_grace = 4.0
        """Seconds a frozen peer that is not stopped gets to dump its own stacks and exit
        (its faulthandler fallback) before it is ended (the watchdog sets it from the
        timeout: ``frozen_after - dead_after`` and a second)."""
        self.comm_error: Callable[[], str | None] = lambda: None
        """This rank's collective that failed under it, if one did (for the stack dump)."""
        self.before_exit: list[Callable[[], Any]] = []
        """Called (errors logged, never raised) before the process exits on a verdict: the
        loop's own buffers that ``os._exit`` would otherwise lose."""

    @property
    def folder(self) -> Path:
        """``run_dir/hangs/<id>``: stacks and report of this run's hang, if any."""
        return self.run_dir / "hangs" / self.hang_id

    def act(self, verdict: Verdict, offline: bool = False) -> None:
        """Dump, report, wait for the others' dumps and end the process (once)."""
        if self.exiting.is_set():
            return
        self.exiting.set()
        self.verdict = verdict
        code = exit_code_for(verdict.kind)
        safety = threading.Timer(SAFETY_EXIT_S, self._exit_fn, args=(code,))
        safety.name = "trainguard-exit-deadline"
        safety.daemon = True
        safety.start()
        if self.fallback is not None:
            self.fallback.disarm()
        if self.signals is not None:
            self.signals.close()  # a launcher's SIGTERM now ends a rank trainguard is ending
        if not offline:
            attempt(self.channel.ack)
            verdict = attempt(lambda: self._end_frozen(verdict)) or verdict
            self.verdict = verdict
        stacks, native = self._dump_stacks(verdict)
        if not offline:
            attempt(self.channel.dumped)
        if verdict.reporter == self.rank:
            attempt(lambda: write_report(self.folder, self._build_report(verdict, code)))
        self._record(verdict, code, stacks, native)
        if not offline:
            self._await_dumps(len(self.members) - len(set(verdict.silent)))
        self._flush()
        if not offline:
            self._await_failed_processes(verdict)
        self._exit_fn(code)
        safety.cancel()

    def _end_frozen(self, verdict: Verdict) -> Verdict:
        """Culprits of a peer failure whose heartbeats stopped while their process lives on
        this host are frozen (``frozen.py``): each is ended with SIGKILL, a note stands in
        for its stack dump, a ``frozen_rank`` event is written, and the verdict's reason
        says so (the report's too, when this rank writes it)."""
        if verdict.kind != PEER_FAILURE or own_failure(verdict.kind, verdict.culprits, verdict.by):
            return verdict
        beats, _ = self.channel.read(list(verdict.culprits))
        found = still_frozen(frozen_ranks(beats, self._host, self._pid), self.own_dump_grace)
        for rank in found:
            if verdict.reporter != self.rank:  # the reporter looks first (its report says
                gone_within(rank, REPORTER_FIRST_S)  # "frozen"), then ends it; else we do
            ended = end(rank)
            note = functools.partial(
                write_note, self.folder / stack_file(rank.rank), rank, self.rank
            )
            attempt(note)
            self.events.write(
                "frozen_rank",
                self.progress.step,
                rank=rank.rank,
                pid=rank.pid,
                process_state=rank.state,
                last_step=rank.step,
                last_phase=rank.phase,
                ended=ended,
            )
        if not found:
            return verdict
        said = "; ".join(rank.describe() for rank in found)
        return replace(verdict, reason=f"{verdict.reason}; {said}; ended with SIGKILL")

    def _await_failed_processes(self, verdict: Verdict) -> None:
        """A rank that failed with an exception published it and goes on ending its own
        process (its exception, the interpreter's and gloo's teardown: about a second). A
        launcher that ends every worker at the first exit it sees (torchrun's agent, one
        per host) would see this rank's 92 first and name it as the root cause, and end the
        failing rank with SIGTERM. So wait, at most ``FAILED_EXIT_WAIT_S``, until the failing
        processes on this host have ended (the ones on other hosts have their own agent)."""
        if verdict.kind != PEER_FAILURE or verdict.by not in verdict.culprits:
            return  # not a failure the failing rank published itself (a death, a hang)
        beats = attempt(lambda: self.channel.read(list(verdict.culprits))[0]) or {}
        pids = [
            b.pid
            for b in beats.values()
            if b is not None and b.host == self._host and b.pid and b.pid != self._pid
        ]
        if not pids:
            return
        deadline = time.monotonic() + FAILED_EXIT_WAIT_S
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if process_state(pid) is not None]
            if pids:
                time.sleep(0.05)
        # then long enough for the launcher to see that exit on its own (torchrun polls every
        # 0.1 s and stamps failures to the second): it ends this process itself, with SIGTERM
        time.sleep(FAILED_EXIT_GRACE_S)

    def _dump_stacks(self, verdict: Verdict) -> tuple[Path, bool]:
        """This process's stacks under the verdict's header; whether py-spy's are in it."""
        stacks = self.folder / stack_file(self.rank)
        header = (
            f"trainguard stack dump: rank {self.rank} (pid {self._pid} on {self._host}), "
            f"{verdict.kind} {self.hang_id}, step {self.progress.step}, phase "
            f"{self.progress.phase!r}\nculprit ranks: {verdict.culprits}\nreason: {verdict.reason}"
        )
        record = CollectiveRecord.from_dict(self.collective)
        if record is not None:
            header += f"\ncollective: {describe(record)}"
        failed = self.comm_error()
        if failed:
            header += f"\nthis rank's collective failed under it: {failed[:1000]}"
        native = attempt(lambda: write_stack_dump(stacks, header))
        return stacks, bool(native)

    def _record(self, verdict: Verdict, code: int, stacks: Path, native: bool) -> None:
        """The ``hang`` / ``peer_failure`` event and the log line."""
        report = self.folder / "report.json"
        self.events.write(
            verdict.kind,
            self.progress.step,
            hang_id=self.hang_id,
            culprits=verdict.culprits,
            reason=verdict.reason,
            decided_by=verdict.by,
            phase=self.progress.phase,
            exit_code=code,
            stacks=str(stacks),
            native_stacks=native,
            report=str(report),
        )
        logger.error(
            "trainguard: %s (culprit ranks %s): %s; report %s; rank %d exits with %d",
            verdict.kind,
            verdict.culprits,
            verdict.reason,
            report,
            self.rank,
            code,
        )

    def _await_dumps(self, expected: int) -> None:
        """Every rank waits (briefly) until every live rank has dumped its stacks: the first
        rank to exit makes torchrun terminate the others, which must not cut a dump short."""
        deadline = time.monotonic() + self._ack_wait
        while time.monotonic() < deadline:
            count = attempt(self.channel.dumps)
            if count is None or count >= expected:
                break
            time.sleep(0.05)
        if self.store_host == self.rank:
            time.sleep(0.25)  # let the others read the final count before the store goes

    def _flush(self) -> None:
        for flush in self.before_exit:  # e.g. the step path's buffered metrics log
            attempt(flush)
        self.events.close()
        for handler in logging.getLogger().handlers:
            attempt(handler.flush)
        for stream in (sys.stdout, sys.stderr):
            attempt(stream.flush)
