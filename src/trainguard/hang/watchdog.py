"""The watchdog thread: heartbeats through the job's c10d store, and verdicts on hung and
dead ranks.

One daemon thread per rank (started by ``Guard`` when torch.distributed is initialized and
``hang_timeout != 0``). Every tick it

1. re-arms the faulthandler fallback (``stacks.FrozenDump``),
2. notes the local loop's progress (``Progress.beats``) and feeds finished stalls to the
   adaptive timeout (``timeout.StallMeter``, ``timeout.TimeoutLearner``),
3. writes its heartbeat (once the loop has stalled for ``timeout.record_after``, with the
   collective it waits in: ``collectives.CollectiveProbe``) and reads the heartbeats it
   watches and the verdict key in one ``multi_get`` (``channel.StoreChannel``): a few
   watcher ranks read every member's, the others only the watchers' (``watchers.Watch``),
4. acts on a verdict another rank published, or judges its views itself
   (``rules.assess`` on a watcher) and publishes its verdict (the first one wins).

``Watchdog`` composes the two other halves: ``exit_path.ExitPath`` acts on a verdict (stack
dump, report, exit code) and ``failure.FailurePublisher`` publishes this rank's own
exception from the main thread. The main thread only does plain attribute writes on
``Progress`` per step; it touches the store only when a rank fails with an exception.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.events import EventLog
from trainguard.hang import flight_recorder, keys
from trainguard.hang import timeout as timing
from trainguard.hang.channel import StoreChannel
from trainguard.hang.collectives import CollectiveProbe
from trainguard.hang.exit_path import ACK_WAIT_S, SAFETY_EXIT_S, ExitPath
from trainguard.hang.failure import FailurePublisher
from trainguard.hang.heartbeat import Heartbeat
from trainguard.hang.progress import Progress
from trainguard.hang.report import build_report, stack_file
from trainguard.hang.rules import PEER_FAILURE, Verdict, effective_timeout
from trainguard.hang.signal_dump import SignalDump, signal_file
from trainguard.hang.stacks import FrozenDump
from trainguard.hang.timeout import StallMeter, TimeoutLearner
from trainguard.hang.watchers import Watch, select_watchers, watcher_count

logger = logging.getLogger(__name__)


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
        watchers: list[int] | None = None,
        probe: CollectiveProbe | None = None,
    ) -> None:
        """``watchers``: the ranks that read every heartbeat (default: ``select_watchers``
        with ``TRAINGUARD_HANG_WATCHERS``, see ``watchers``). ``probe``: reads the collective
        this rank waits in once its loop stalled (None: no collective is published)."""
        self.channel = channel
        self.main_channel = main_channel
        self.rank = channel.rank
        self.members = list(channel.members)
        self.progress = progress
        self.events = events
        self.run_dir = Path(run_dir)
        self.learner = learner
        self.store_host = store_host
        self._clock = clock
        self._install_hooks = install_hooks
        self._use_faulthandler = faulthandler_fallback
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._seq = 0
        self._stopped = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._frozen: FrozenDump | None = None
        self._signals: SignalDump | None = None
        now = clock()
        if watchers is None:
            watchers = select_watchers(self.members, watcher_count())
        self._watch = Watch(self.rank, self.members, watchers, now)
        self._store_ok_at = now
        self._step0 = progress.step
        self._stalls = StallMeter(learner, now)
        self._probe = probe
        self.on_tick: list[Callable[[], Any]] = []
        """Called every tick on the watchdog's thread (errors logged): the metrics log's
        stale lines are written (``StepHistory.flush_if_stale``)."""
        self.on_stall: list[Callable[[], Any]] = []
        """Called at each tick once the loop has stalled for ``record_after`` (the guard's
        ``BusyProbe.arm``: work on another module between steps is progress)."""
        self._logged_timeout: tuple[str, float] | None = None
        self._exit = self._exit_path(exit_fn, ack_wait_s)
        self._failures = self._failure_publisher(ack_wait_s)
        self._exit.comm_error = lambda: self._failures.comm_error

    def before_exit(self, flush: Callable[[], Any]) -> None:
        """Run ``flush`` before this process exits on a hang or peer-failure verdict."""
        self._exit.before_exit.append(flush)

    def _exit_path(self, exit_fn: Callable[[int], Any], ack_wait_s: float) -> ExitPath:
        return ExitPath(
            channel=self.channel,
            progress=self.progress,
            events=self.events,
            run_dir=self.run_dir,
            build_report=self._build_report,
            store_host=self.store_host,
            exit_fn=exit_fn,
            ack_wait_s=ack_wait_s,
        )

    def _failure_publisher(self, ack_wait_s: float) -> FailurePublisher:
        return FailurePublisher(
            channel=self.main_channel,
            progress=self.progress,
            events=self.events,
            exiting=self._exit.exiting,
            ack_wait_s=ack_wait_s,
            await_exit=self._await_exit,
            comm_grace=lambda: self.dead_after + 3.0 * self.tick + 1.0,
        )

    # -- timing -----------------------------------------------------------------------------

    def steps_done(self) -> int:
        """Optimizer steps completed since the watchdog started."""
        return self.progress.step - self._step0

    @property
    def timeout(self) -> float:
        return self.learner.value(self.steps_done(), self.progress.pass_start)

    @property
    def dead_after(self) -> float:
        return timing.dead_after(self.timeout)

    @property
    def tick(self) -> float:
        return timing.tick_interval(self.timeout)

    # -- the hang, if any -------------------------------------------------------------------

    @property
    def hang_id(self) -> str:
        """The run's hang id: every rank's watchdog agrees on it when it starts."""
        return self._exit.hang_id

    @property
    def folder(self) -> Path:
        """``run_dir/hangs/<id>``: stacks and report of this run's hang, if any."""
        return self._exit.folder

    @property
    def verdict(self) -> Verdict | None:
        """The verdict this rank acted on (None while the run is fine)."""
        return self._exit.verdict

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, thread: bool = True) -> None:
        """Register with the store, arm the fallback, install the hooks and (with
        ``thread``) start ticking; without it the caller drives ``tick_once`` (tests)."""
        self._exit.hang_id = self.channel.agree_id(keys.candidate_id())
        self.channel.open()
        self.channel.publish(self._beat())
        if self._use_faulthandler:
            self._frozen = FrozenDump(self.folder / stack_file(self.rank))
            self._frozen.arm(timing.frozen_after(self.timeout))
            self._exit.fallback = self._frozen
            self._signals = self._exit.signals = SignalDump(self.folder / signal_file(self.rank))
        if self._install_hooks:
            self._failures.install_hook()
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
            watchers=self._watch.watchers,
            store_prefix=self.channel.prefix,
            flight_recorder=flight_recorder.setting() if self._probe is not None else None,
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
        self._failures.close()
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.tick + 10.0)
        if self._install_hooks:
            atexit.unregister(self._at_exit)
            self._failures.uninstall_hook()
        if self._exit.exiting.is_set():
            return  # the thread is ending the process
        if self._signals is not None:
            self._signals.close()  # before the folder is removed when empty
        final = "failed" if self._failures.failed else state
        try:
            self.main_channel.publish(self._beat(final))
        except Exception as exc:
            logger.debug("trainguard watchdog: final heartbeat not published: %s", exc)
        if self._frozen is not None:
            self._frozen.close(remove_if_empty=True)
        self.events.write("watchdog_stop", self.progress.step, state=final)

    def _at_exit(self) -> None:
        self.stop("closed")

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.tick):
                try:
                    self.tick_once()
                except Exception:
                    logger.exception("trainguard watchdog: tick failed")
                if self._exit.exiting.is_set():
                    return
        finally:
            if self._frozen is not None and not self._exit.exiting.is_set():
                self._frozen.disarm()

    def tick_once(self) -> None:
        """One watchdog tick (the thread calls it; tests may call it directly)."""
        now = self._clock()
        if self._frozen is not None:
            self._frozen.arm(timing.frozen_after(self.timeout))
        self._stalls.observe(self.progress, self.steps_done(), now)
        self._log_timeout()
        for call in self.on_tick:
            try:
                call()
            except Exception as exc:  # monitoring must not take the job down
                logger.debug("trainguard watchdog: a tick's call failed: %s", exc)
        if self.on_stall and self._stalled(now):
            for arm in self.on_stall:
                arm()
        collective = self._collective(now)
        self._exit.collective = collective
        try:
            self.channel.publish(self._beat(collective=collective))
            beats, verdict = self.channel.read(self._watch.reads())
        except Exception as exc:
            self._store_trouble(now, exc)
            return
        self._store_ok_at = now
        self._watch.update(beats, now)
        if self._failures.failed or self._exit.exiting.is_set():
            return
        if verdict is None:
            verdict = self._watch.judge(now, self.timeout, self.dead_after, self.tick)
            if verdict is None:
                return
            verdict = self.channel.propose(verdict)
        if not self._failures.failed:  # set before this rank publishes its own failure
            # a frozen peer that is not stopped gets to dump its own stacks first (frozen.py)
            self._exit.own_dump_grace = timing.frozen_after(self.timeout) - self.dead_after + 1
            self._exit.act(verdict)

    def _stalled(self, now: float) -> bool:
        """The loop (not before it, nor after the guard closed, nor in a user phase) made no
        progress for ``record_after``."""
        p = self.progress
        if p.phase in ("init", "closed") or p.in_user_phase:
            return False
        return self._stalls.stalled_for(now) >= timing.record_after(self.timeout)

    def _collective(self, now: float) -> dict[str, Any] | None:
        """The collective this rank waits in, once its loop has stalled for
        ``record_after`` (not before the loop or after the guard closed; in a user phase and
        between loops too: neither excuses a deadlock, ``rules.phase_deadlock``)."""
        p = self.progress
        if self._probe is None or p.phase in ("init", "closed"):
            return None
        if self._stalls.stalled_for(now) < timing.record_after(self.timeout):
            return None
        try:
            self._probe.min_dump_interval = timing.dump_interval(self.timeout)
            return self._probe.read().to_dict()
        except Exception as exc:  # monitoring must not take the job down
            logger.debug("trainguard watchdog: collective not read: %s", exc)
            return None

    def _beat(self, state: str = "running", collective: dict[str, Any] | None = None) -> Heartbeat:
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
            collective=collective,
        )

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
        if self._failures.failed or age < self.dead_after:
            logger.debug("trainguard watchdog: store error (%.1fs): %s", age, exc)
            return
        host = self.store_host
        culprits = [host] if host is not None and host != self.rank else []
        where = f"hosted by rank {host}" if host is not None else "hosted by the launcher"
        reason = f"the c10d store ({where}) has not answered for {age:.1f}s: {exc}"
        verdict = Verdict(
            PEER_FAILURE, culprits, reason, by=self.rank, reporter=self.rank, silent=culprits
        )
        self._exit.act(verdict, offline=True)

    def _build_report(self, verdict: Verdict, code: int) -> dict[str, Any]:
        """``report.json`` from the heartbeats this rank has seen."""
        views = self._watch.report_views(self.channel, self._clock())
        return build_report(
            self.hang_id,
            verdict,
            views,
            timeout=effective_timeout(views, self.timeout),
            dead_after=self.dead_after,
            exit_code=code,
        )

    # -- failures of this rank (main thread) ------------------------------------------------

    def publish_failure(self, exc: BaseException) -> None:
        """This rank is going down with ``exc``: tell the other ranks so they exit now
        (``failure.FailurePublisher``; nothing once the watchdog stopped)."""
        self._failures.publish(exc)

    def _await_exit(self, timeout: float) -> bool:
        """Wait until the watchdog acts on a verdict (it then ends the process)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return self._exit.exiting.is_set()
        if not self._exit.exiting.wait(timeout):
            return False
        thread.join(SAFETY_EXIT_S)
        return True
