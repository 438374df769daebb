"""A hopeless restart is refused (docs/recovery.md).

At the first ``watch()`` of a run with ``resume=True`` (the checkpoint is loaded, the data is
known) every rank reads ``run_dir/stop.json`` (``stop.py``) and compares it with what this
attempt runs with; one all-reduce makes the verdict the same on every rank:

- no record: nothing to do;
- a new launch (``TORCHELASTIC_RESTART_COUNT`` 0 on every rank: a person or a scheduler
  started it) runs, and the record is cleared; a warning says when nothing changed;
- ``TRAINGUARD_FORCE_RESTART=1``: the restart runs, the record is cleared;
- something changed (config, checkpoint, data, script): the restart runs, the record is
  cleared;
- otherwise the restart is refused: one line in the log, a ``restart_refused`` event, and
  every rank exits with ``EXIT_DO_NOT_RESTART`` (93) after local rank 0 stopped torchrun's
  agent (``elastic.stop_agent``), so the job ends instead of burning its restarts.

A cleared record moves to ``run_dir/recovery/stop-cleared.json``; the next stop writes a new
one. The check is collective: every rank calls it at its first ``watch()``.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.config import GuardConfig
from trainguard.distributed.elastic import restart_count, stop_agent
from trainguard.events import EventLog
from trainguard.exitcodes import EXIT_DO_NOT_RESTART
from trainguard.recovery.agree import max_over_ranks
from trainguard.recovery.stop import (
    StopRecord,
    changed_inputs,
    data_identity,
    fingerprint,
    fingerprint_inputs,
    read_record,
    retire_record,
    stop_path,
)

logger = logging.getLogger(__name__)

FORCE_VAR = "TRAINGUARD_FORCE_RESTART"


class Verdict(enum.Enum):
    NO_RECORD = "no_record"
    NEW_LAUNCH = "new_launch"
    FORCED = "forced"
    CHANGED = "changed"
    REFUSED = "refused"


def forced(env: Mapping[str, str]) -> bool:
    return env.get(FORCE_VAR, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class LocalView:
    """What one rank sees; ``flags()`` go through one MAX all-reduce."""

    seen: bool
    """This rank read a stop record."""
    differs: bool
    """... and what this attempt runs with differs from it."""
    restarted: bool
    forced: bool

    def flags(self) -> list[int]:
        return [int(self.seen), int(self.differs), int(self.restarted), int(self.forced)]


def decide(flags: list[int]) -> Verdict:
    """The verdict from the flags agreed over the ranks (any rank's "yes" counts)."""
    seen, differs, restarted, force = (bool(flag) for flag in flags)
    if not seen:
        return Verdict.NO_RECORD
    if not restarted:
        return Verdict.NEW_LAUNCH
    if force:
        return Verdict.FORCED
    return Verdict.CHANGED if differs else Verdict.REFUSED


def clear_hint(run_dir: Path | str) -> str:
    return (
        f"to restart anyway set {FORCE_VAR}=1; or fix the cause and relaunch (a new launch "
        f"is not refused); record: {stop_path(run_dir)}"
    )


def refusal_line(record: StopRecord, attempt: int, run_dir: Path | str) -> str:
    """The one line that says why a restart is refused and how to clear it."""
    start = record.checkpoint or "a fresh start (no good checkpoint)"
    what = record.message.removeprefix(f"step {record.step}: ")
    return (
        f"trainguard: restart {attempt} refused (exit {EXIT_DO_NOT_RESTART}): it would resume "
        f"from {start} into the failure that stopped the last attempt at step {record.step} "
        f"({record.cause}: {what}; bundle {record.bundle or 'none'}) with nothing changed "
        f"(config, data, checkpoint, script); {clear_hint(run_dir)}"
    )


@dataclass
class RestartCheck:
    """Everything the check needs; ``run()`` is collective."""

    config: GuardConfig
    checkpoint: str | None
    """The checkpoint this attempt resumed from, relative to ``run_dir`` (None: none)."""
    data: Any
    events: EventLog
    group: dist.ProcessGroup | None
    device: torch.device
    rank: int
    env: Mapping[str, str] = field(default_factory=lambda: os.environ)
    exit_fn: Callable[[int], Any] | None = None
    """How the process ends (None: ``os._exit``, looked up when it is called)."""

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)

    def run(self) -> Verdict:
        record = read_record(self.run_dir)
        now = fingerprint_inputs(self.config, self.checkpoint, data_identity(self.data))
        differs = record is not None and record.fingerprint != fingerprint(now)
        attempt = restart_count(self.env)
        view = LocalView(record is not None, differs, attempt > 0, forced(self.env))
        verdict = decide(max_over_ranks(view.flags(), self.group, self.device))
        if verdict is Verdict.NO_RECORD:
            return verdict
        changed = changed_inputs(record.inputs, now) if record is not None else []
        if verdict is Verdict.REFUSED:  # also where this rank did not see the record
            self._refuse(record, attempt)  # ends the process (exit_fn)
            return verdict
        self._clear(verdict, record, changed, attempt)
        return verdict

    def _clear(
        self, verdict: Verdict, record: StopRecord | None, changed: list[str], attempt: int
    ) -> None:
        """The attempt goes past the record: say so, and move the record aside (rank 0)."""
        step = record.step if record is not None else None
        self.events.write(
            "stop_record_cleared", step, verdict=verdict.value, changed=changed, attempt=attempt
        )
        if self.rank != 0:
            return
        if verdict is Verdict.NEW_LAUNCH and not changed and record is not None:
            logger.warning(
                "trainguard: the last run stopped at step %d on %s, and this launch resumes "
                "from the same checkpoint with the same config and data: it may stop again",
                record.step,
                record.cause,
            )
        elif verdict is Verdict.FORCED and record is not None:
            logger.warning(
                "trainguard: %s=1: restart %d goes on, though it may run into the failure that "
                "stopped the last attempt at step %d (%s)",
                FORCE_VAR,
                attempt,
                record.step,
                record.cause,
            )
        else:
            logger.info("trainguard: stop record cleared (%s; changed: %s)", verdict.value, changed)
        retire_record(self.run_dir, {"verdict": verdict.value, "changed": changed})

    def _refuse(self, record: StopRecord | None, attempt: int) -> None:
        """Collective: every rank leaves with EXIT_DO_NOT_RESTART; torchrun's agent is stopped
        first, so it does not take the exit for a failure to restart. ``record`` None: this
        rank could not read the record the others read (the run folder lags here)."""
        if record is not None:
            line = refusal_line(record, attempt, self.run_dir)
        else:
            line = f"trainguard: restart {attempt} refused (exit {EXIT_DO_NOT_RESTART}) by the "
            line += f"other ranks' reading of {stop_path(self.run_dir)}"
        if self.rank == 0:
            logger.error("%s", line)
        # The agent's shutdown sends the workers SIGTERM: ignore it, so that every rank ends
        # with the exit code. No rank signals before all ignore, none exits before all signalled.
        _ignore_termination()
        self._barrier()
        agent = stop_agent(self.env)
        self._barrier()
        what = asdict(record) if record is not None else {}
        self.events.write(
            "restart_refused",
            what.get("step"),
            cause=what.get("cause"),
            bundle=what.get("bundle"),
            checkpoint=what.get("checkpoint"),
            attempt=attempt,
            stopped_attempt=what.get("attempt"),
            fingerprint=what.get("fingerprint"),
            exit_code=EXIT_DO_NOT_RESTART,
            agent=agent,
            message=line,
        )
        _flush_logs()
        (self.exit_fn or os._exit)(EXIT_DO_NOT_RESTART)

    def _barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=self.group)


def _ignore_termination() -> None:
    """SIGTERM and SIGINT ignored from here to the exit (main thread only: elsewhere Python
    cannot set handlers, and the agent's SIGTERM may then end a rank before its 93)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except ValueError:
            return


def _flush_logs() -> None:
    """``os._exit`` skips the interpreter's flushing: the line must reach stderr first."""
    handlers = list(logging.getLogger().handlers)
    last_resort = logging.lastResort
    if last_resort is not None:
        handlers.append(last_resort)
    for handler in handlers:
        try:
            handler.flush()
        except Exception:  # a broken handler must not keep the process alive
            continue
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            continue
