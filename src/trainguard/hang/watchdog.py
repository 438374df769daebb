"""The watchdog: heartbeats through the job's c10d store, hang and dead-rank detection,
stack dumps, one report, and an exit code on every live rank.

One daemon thread per rank (started by ``Guard`` when torch.distributed is initialized and
``hang_timeout != 0``). Every tick it

1. re-arms the faulthandler fallback (``stacks.FrozenDump``),
2. notes the local loop's progress (``Progress.beats``) and feeds finished stalls to the
   adaptive timeout (``hang_timeout.TimeoutLearner``),
3. writes its heartbeat and reads every member's heartbeat and the verdict key in one
   ``multi_get`` (``channel.StoreChannel``),
4. acts on a verdict another rank published, or judges the views itself
   (``hang_rules.assess``) and publishes its verdict (the first one wins).

Acting on a verdict (``_finish``): acknowledge it, dump this process's stacks to
``run_dir/hangs/<id>/rank-<r>.txt``, count the dump in the store, write the report when this
rank is the verdict's reporter and a ``hang`` / ``peer_failure`` event, wait (at most
``ACK_WAIT_S``) until every live rank has dumped (the first rank to exit makes torchrun
terminate the others), then ``os._exit`` with ``EXIT_HANG`` or ``EXIT_PEER_FAILURE``: the
main thread may be blocked in a collective forever, so exiting the process is the only way
out.

The main thread only does plain attribute writes on ``Progress`` per step; it touches the
store only when a rank fails with an exception (``publish_failure``, from ``Guard.__exit__``
or the chained ``sys.excepthook``).
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist

from trainguard.events import EventLog
from trainguard.exitcodes import EXIT_HANG, EXIT_PEER_FAILURE
from trainguard.hang import timeout as timing
from trainguard.hang.channel import StoreChannel, own_connection
from trainguard.hang.heartbeat import Heartbeat, PeerTracker
from trainguard.hang.report import build_report, stack_file, write_report
from trainguard.hang.rules import (
    HANG,
    PEER_FAILURE,
    Verdict,
    assess,
    effective_timeout,
    failure_verdict,
    is_comm_error,
    should_publish,
)
from trainguard.hang.stacks import FrozenDump, write_stack_dump
from trainguard.hang.timeout import TimeoutLearner
from trainguard.progress import Progress

logger = logging.getLogger(__name__)

ACK_WAIT_S = 5.0
"""How long a rank waits for the others to read a verdict, or to dump their stacks."""

SAFETY_EXIT_S = 30.0
"""A rank acting on a verdict exits after this long even if dumping or writing hangs."""

_generations = itertools.count()

ExcHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


def exit_code_for(kind: str) -> int:
    return EXIT_HANG if kind == HANG else EXIT_PEER_FAILURE


def _store_host() -> int | None:
    """The rank whose process serves the store: rank 0 for ``init_process_group``'s own
    TCPStore, none under torchrun (the agent serves it)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"
    return None if agent else 0


def store_prefix(generation: int) -> str:
    """Keys of one Guard: torchrun's store outlives a restart, so the run id and the restart
    count are part of the prefix (``generation`` counts the Guards of this process)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    if run or attempt:
        return f"trainguard/{run}/attempt{attempt}/{generation}"
    return f"trainguard/{generation}"


def _candidate_id() -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    suffix = f"-attempt{attempt}" if attempt is not None else ""
    return f"{stamp}{suffix}-{secrets.token_hex(2)}"


class Watchdog:
    """One rank's watchdog. ``start()`` it once; ``stop()`` it when the guard closes."""

    def __init__(
        self,
        *,
        channel: StoreChannel,
        main_channel: StoreChannel,
        progress: Progress,
        events: EventLog,
        run_dir: Path,
        learner: TimeoutLearner,
        store_host: int | None = 0,
        clock: Callable[[], float] = time.monotonic,
        exit_fn: Callable[[int], Any] = os._exit,
        install_hooks: bool = True,
        faulthandler_fallback: bool = True,
        ack_wait_s: float = ACK_WAIT_S,
    ) -> None:
        self.channel = channel
        self.main_channel = main_channel
        self.rank = channel.rank
        self.members = list(channel.members)
        self.progress = progress
        self.events = events
        self.run_dir = Path(run_dir)
        self.learner = learner
        self.store_host = store_host
        self.hang_id = ""
        self.verdict: Verdict | None = None
        self._clock = clock
        self._exit_fn = exit_fn
        self._install_hooks = install_hooks
        self._use_faulthandler = faulthandler_fallback
        self._ack_wait = ack_wait_s
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._seq = 0
        self._failed = False
        self._stopped = False
        self._stop = threading.Event()
        self._exiting = threading.Event()
        self._thread: threading.Thread | None = None
        self._frozen: FrozenDump | None = None
        self._previous_hook: ExcHook | None = None
        now = clock()
        self._tracker = PeerTracker(self.members, now)
        self._store_ok_at = now
        self._step0 = progress.step
        self._last_beats = -1
        self._last_change = now
        self._stall_from_steps = 0
        self._stall_excluded = True
        self._logged_timeout: tuple[str, float] | None = None

    # -- timing -----------------------------------------------------------------------------

    def steps_done(self) -> int:
        """Optimizer steps completed since the watchdog started."""
        return self.progress.step - self._step0

    @property
    def timeout(self) -> float:
        return self.learner.value(self.steps_done())

    @property
    def dead_after(self) -> float:
        return timing.dead_after(self.timeout)

    @property
    def tick(self) -> float:
        return timing.tick_interval(self.timeout)

    @property
    def folder(self) -> Path:
        """``run_dir/hangs/<id>``: stacks and report of this run's hang, if any."""
        return self.run_dir / "hangs" / self.hang_id

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, thread: bool = True) -> None:
        """Register with the store, arm the fallback, install the hooks and (with
        ``thread``) start ticking; without it the caller drives ``tick_once`` (tests)."""
        self.hang_id = self.channel.agree_id(_candidate_id())
        self.channel.open()
        self.channel.publish(self._beat())
        if self._use_faulthandler:
            self._frozen = FrozenDump(self.folder / stack_file(self.rank))
            self._frozen.arm(timing.frozen_after(self.timeout))
        if self._install_hooks:
            self._previous_hook = sys.excepthook
            sys.excepthook = self._excepthook
            atexit.register(self._at_exit)
        self.events.write(
            "watchdog",
            self.progress.step,
            hang_id=self.hang_id,
            hang_timeout=self.learner.fixed,
            rule=self.learner.rule(0),
            dead_after=self.dead_after,
            tick=self.tick,
            members=self.members,
            store_prefix=self.channel.prefix,
        )
        self._log_timeout()
        if thread:
            self._thread = threading.Thread(
                target=self._run, name="trainguard-watchdog", daemon=True
            )
            self._thread.start()

    def stop(self, state: str = "closed") -> None:
        """Stop the thread and tell the peers this rank is done (``closed``) or failing."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.tick + 10.0)
        if self._install_hooks:
            atexit.unregister(self._at_exit)
            if sys.excepthook == self._excepthook and self._previous_hook is not None:
                sys.excepthook = self._previous_hook
        if self._exiting.is_set():
            return  # the thread is ending the process
        final = "failed" if self._failed else state
        try:
            self.main_channel.publish(self._beat(final))
        except Exception as exc:
            logger.debug("trainguard watchdog: final heartbeat not published: %s", exc)
        if self._frozen is not None:
            self._frozen.close(remove_if_empty=True)
        self.events.write("watchdog_stop", self.progress.step, state=final)

    def _at_exit(self) -> None:
        self.stop("closed")

    def _excepthook(
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
            self.publish_failure(exc)
        finally:
            if symptom:
                previous(exc_type, exc, tb)

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.tick):
                try:
                    self.tick_once()
                except Exception:
                    logger.exception("trainguard watchdog: tick failed")
                if self._exiting.is_set():
                    return
        finally:
            if self._frozen is not None and not self._exiting.is_set():
                self._frozen.disarm()

    def tick_once(self) -> None:
        """One watchdog tick (the thread calls it; tests may call it directly)."""
        now = self._clock()
        if self._frozen is not None:
            self._frozen.arm(timing.frozen_after(self.timeout))
        self._observe_progress(now)
        try:
            self.channel.publish(self._beat())
            beats, verdict = self.channel.read()
        except Exception as exc:
            self._store_trouble(now, exc)
            return
        self._store_ok_at = now
        for rank, beat in beats.items():
            self._tracker.update(rank, beat, now)
        if self._failed or self._exiting.is_set():
            return
        if verdict is None:
            verdict = assess(self._tracker.views(now), self.rank, self.timeout, self.dead_after)
            if verdict is None:
                return
            verdict = self.channel.propose(verdict)
        if not self._failed:  # set before this rank publishes its own failure
            self._finish(verdict)

    def _beat(self, state: str = "running") -> Heartbeat:
        self._seq += 1
        p = self.progress
        return Heartbeat(
            seq=self._seq,
            step=p.step,
            phase=p.phase,
            beats=p.beats,
            user_phase=p.in_user_phase,
            timeout=self.timeout,
            state=state,
            host=self._host,
            pid=self._pid,
        )

    def _observe_progress(self, now: float) -> None:
        """Feed the local loop's finished stalls to the adaptive timeout."""
        p = self.progress
        excluded = p.in_user_phase or p.phase in ("init", "done", "closed")
        if p.beats != self._last_beats:
            counted = self._last_beats >= 0 and not self._stall_excluded
            if counted and self._stall_from_steps >= self.learner.warmup_steps:
                self.learner.observe(now - self._last_change, self.steps_done())
            self._last_beats = p.beats
            self._last_change = now
            self._stall_from_steps = self.steps_done()
            self._stall_excluded = excluded
        else:
            self._stall_excluded = self._stall_excluded or excluded
        self._log_timeout()

    def _log_timeout(self) -> None:
        steps = self.steps_done()
        rule, value = self.learner.rule(steps), self.learner.value(steps)
        last = self._logged_timeout
        if last is not None and last[0] == rule and value <= last[1] * 1.1:
            return
        self._logged_timeout = (rule, value)
        self.events.write(
            "hang_timeout",
            self.progress.step,
            timeout=value,
            rule=rule,
            longest_stall=round(self.learner.longest_stall, 3),
            dead_after=timing.dead_after(value),
        )
        logger.info("trainguard: hang timeout %.0fs (%s)", value, rule)

    def _store_trouble(self, now: float, exc: Exception) -> None:
        age = now - self._store_ok_at
        if self._failed or age < self.dead_after:
            logger.debug("trainguard watchdog: store error (%.1fs): %s", age, exc)
            return
        host = self.store_host
        culprits = [host] if host is not None and host != self.rank else []
        where = f"hosted by rank {host}" if host is not None else "hosted by the launcher"
        reason = f"the c10d store ({where}) has not answered for {age:.1f}s: {exc}"
        verdict = Verdict(
            PEER_FAILURE, culprits, reason, by=self.rank, reporter=self.rank, silent=culprits
        )
        self._finish(verdict, offline=True)

    # -- acting on a verdict ----------------------------------------------------------------

    def _finish(self, verdict: Verdict, offline: bool = False) -> None:
        if self._exiting.is_set():
            return
        self._exiting.set()
        self.verdict = verdict
        code = exit_code_for(verdict.kind)
        safety = threading.Timer(SAFETY_EXIT_S, self._exit_fn, args=(code,))
        safety.name = "trainguard-exit-deadline"
        safety.daemon = True
        safety.start()
        if self._frozen is not None:
            self._frozen.disarm()
        if not offline:
            self._try(self.channel.ack)
        stacks = self.folder / stack_file(self.rank)
        header = (
            f"trainguard stack dump: rank {self.rank} (pid {self._pid} on {self._host}), "
            f"{verdict.kind} {self.hang_id}, step {self.progress.step}, phase "
            f"{self.progress.phase!r}\nculprit ranks: {verdict.culprits}\nreason: {verdict.reason}"
        )
        native = self._try(lambda: write_stack_dump(stacks, header))
        if not offline:
            self._try(self.channel.dumped)
        report = self.folder / "report.json"
        if verdict.reporter == self.rank:
            self._try(lambda: self._write_report(verdict, code))
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
            native_stacks=bool(native),
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
        if not offline:
            self._await_dumps(len(self.members) - len(set(verdict.silent)))
        self._flush()
        self._exit_fn(code)
        safety.cancel()

    def _write_report(self, verdict: Verdict, code: int) -> None:
        views = self._tracker.views(self._clock())
        report = build_report(
            self.hang_id,
            verdict,
            views,
            timeout=effective_timeout(views, self.timeout),
            dead_after=self.dead_after,
            exit_code=code,
        )
        write_report(self.folder, report)

    def _await_dumps(self, expected: int) -> None:
        """Every rank waits (briefly) until every live rank has dumped its stacks: the first
        rank to exit makes torchrun terminate the others, which must not cut a dump short."""
        deadline = time.monotonic() + self._ack_wait
        while time.monotonic() < deadline:
            count = self._try(self.channel.dumps)
            if count is None or count >= expected:
                break
            time.sleep(0.05)
        if self.store_host == self.rank:
            time.sleep(0.25)  # let the others read the final count before the store goes

    def _await_acks(self, channel: StoreChannel, expected: int) -> None:
        """The rank whose process serves the store waits (briefly) until the others have
        read the verdict: once it exits, nobody can read anything."""
        if self.store_host != self.rank:
            return
        deadline = time.monotonic() + self._ack_wait
        while time.monotonic() < deadline:
            count = self._try(channel.acks)
            if count is None or count >= expected:
                return
            time.sleep(0.05)

    def _flush(self) -> None:
        self.events.close()
        for handler in logging.getLogger().handlers:
            self._try(handler.flush)
        for stream in (sys.stdout, sys.stderr):
            self._try(stream.flush)

    @staticmethod
    def _try(action: Callable[[], Any]) -> Any:
        try:
            return action()
        except Exception as exc:
            logger.warning("trainguard watchdog: %s", exc)
            return None

    # -- failures of this rank (main thread) ------------------------------------------------

    def publish_failure(self, exc: BaseException) -> None:
        """This rank is going down with ``exc``: tell the other ranks so they exit now.

        An error from a collective or the store is likely a symptom of another rank's death:
        the watchdog first gets the chance to find that rank (and ends the process with
        ``EXIT_PEER_FAILURE``). Exceptions raised on every rank by design
        (``NonFiniteError``) and ``PeerFailureError`` are not published."""
        if self._stopped or not should_publish(exc):
            return
        if self._exiting.is_set() or self._verdict_published():
            self._await_exit(SAFETY_EXIT_S)
            return
        if is_comm_error(exc) and self._await_exit(self.dead_after + 3.0 * self.tick + 1.0):
            return
        self._failed = True
        mine = failure_verdict(self.rank, self.members, exc)
        try:
            held = self.main_channel.propose(mine)
        except Exception as err:
            logger.warning("trainguard: could not publish this rank's failure: %s", err)
            return
        if held != mine:  # another rank's verdict came first: act on it
            self._failed = False
            self._await_exit(SAFETY_EXIT_S)
            return
        self.events.write("failure_published", self.progress.step, reason=mine.reason)
        self._await_acks(self.main_channel, len(self.members) - 1)

    def _verdict_published(self) -> bool:
        try:
            return self.main_channel.read_verdict() is not None
        except Exception:
            return False

    def _await_exit(self, timeout: float) -> bool:
        """Wait until the watchdog acts on a verdict (it then ends the process)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return self._exiting.is_set()
        if not self._exiting.wait(timeout):
            return False
        thread.join(SAFETY_EXIT_S)
        return True


def start_watchdog(
    progress: Progress,
    events: EventLog,
    hang_timeout: float | None,
    run_dir: Path,
    group: dist.ProcessGroup | None = None,
) -> Watchdog | None:
    """Start the watchdog of a Guard; None when torch.distributed is not initialized or
    ``hang_timeout == 0``."""
    if hang_timeout == 0 or not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    rank = dist.get_rank()
    if group is not None:
        members = sorted(dist.get_process_group_ranks(group))
    else:
        members = list(range(dist.get_world_size()))
    learner = TimeoutLearner(fixed=hang_timeout)
    io_timeout = min(5.0, max(1.0, timing.dead_after(learner.value(0)) / 2.0))
    store = distributed_c10d._get_default_store()
    prefix = store_prefix(next(_generations))
    if group is not None:
        digest = hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:8]
        prefix += f"-{digest}"
    try:
        watchdog = Watchdog(
            channel=StoreChannel(own_connection(store, io_timeout), prefix, rank, members),
            main_channel=StoreChannel(own_connection(store, io_timeout), prefix, rank, members),
            progress=progress,
            events=events,
            run_dir=run_dir,
            learner=learner,
            store_host=_store_host(),
        )
        watchdog.start()
    except Exception as exc:  # monitoring must not take the job down
        logger.warning("trainguard: hang watchdog not started: %s", exc)
        events.write("watchdog_unavailable", progress.step, error=f"{type(exc).__name__}: {exc}")
        return None
    return watchdog
