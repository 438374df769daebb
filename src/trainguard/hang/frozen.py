"""A peer whose heartbeats stopped while its process lives on: frozen, told apart and ended.

A rank whose heartbeats stopped is dead (its process ended) or frozen: its process exists
but its watchdog thread cannot run (SIGSTOP, a debugger, a driver call that never returns,
a native call holding the GIL). The difference shows only on the rank's own host, in
``/proc/<pid>/stat``. A stopped process never ends by itself: the launcher (torchrun's agent)
sends it SIGTERM, which it cannot handle, and waits 30 s more before SIGKILL, and the job
hangs that long after every other rank has left. So once a peer failure is decided, each
survivor on the frozen rank's host ends it with SIGKILL (``end``): the verdict's reporter
first, the others once it is gone or ``REPORTER_FIRST_S`` later (a process ended by another
survivor is a zombie, no longer seen as frozen, and the report must say "frozen"). A
process that is not stopped first gets the few seconds its own faulthandler fallback needs
to dump its stacks and exit (``still_frozen``). The survivor
writes what was last known of it where its own stack dump would have gone (it can write
none), and says "frozen" in the verdict's reason. On another host a stopped heartbeat stays
"the process died or its interpreter is frozen": nothing more is known there.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from trainguard.hang.heartbeat import Heartbeat

logger = logging.getLogger(__name__)

_STATES = {
    "T": "stopped (SIGSTOP, SIGTSTP or a debugger)",
    "t": "stopped by a tracer (a debugger)",
    "D": "in an uninterruptible wait (a driver or file-system call that does not return)",
}
_OTHERWISE = "alive, but its watchdog thread does not run (the interpreter is blocked)"


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``/proc/<pid>/stat``: R, S, D, T, ...); None when
    it has ended (or is a zombie) or cannot be read (no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[0]


@dataclass(frozen=True)
class FrozenRank:
    """A rank whose process lives on this host with its heartbeats stopped."""

    rank: int
    pid: int
    state: str
    """Its process state letter (``process_state``)."""
    step: int
    """The step of its last heartbeat (its watchdog ticks: a few steps stale on fast steps)."""
    phase: str
    """The phase of its last heartbeat."""

    def describe(self) -> str:
        what = _STATES.get(self.state, _OTHERWISE)
        return (
            f"rank {self.rank} is frozen: its process (pid {self.pid}) is {what}; its last "
            f"heartbeat said step {self.step}, phase {self.phase!r} (its watchdog's last tick: "
            "the loop may have gone a few steps further before it froze)"
        )


JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "WORLD_SIZE")
"""The launch variables a rank of this job shares with every other: a process whose own
differ (or cannot be read) is not ended, whatever its pid (another machine with the same
host name, another container's pid namespace)."""


def same_job(pid: int, rank: int, environ: dict[str, str]) -> bool:
    """Whether process ``pid`` is rank ``rank`` of the job this process belongs to: its
    ``RANK`` is ``rank`` and its launch variables (``JOB_VARIABLES``) are ours. False when
    its environment cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    theirs = dict(
        entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry
    )
    if theirs.get("RANK") != str(rank):
        return False
    shared = [name for name in JOB_VARIABLES if name in environ]
    return bool(shared) and all(theirs.get(name) == environ[name] for name in shared)


def frozen_ranks(
    beats: dict[int, Heartbeat | None],
    host: str,
    own_pid: int,
    environ: dict[str, str] | None = None,
) -> list[FrozenRank]:
    """The ranks among ``beats`` (culprits whose heartbeats stopped) whose process is on
    ``host``, still exists and is that rank of this job (``same_job``; ``environ``: ours,
    default ``os.environ``): frozen, not dead. A rank that published its own failure or
    closed its guard is none of them (its state is not ``running``)."""
    env = dict(os.environ) if environ is None else environ
    found = []
    for rank, beat in sorted(beats.items()):
        if beat is None or beat.state != "running" or beat.host != host:
            continue
        if not beat.pid or beat.pid == own_pid:
            continue
        state = process_state(beat.pid)
        if state is not None and same_job(beat.pid, rank, env):
            found.append(FrozenRank(rank, beat.pid, state, beat.step, beat.phase))
    return found


STOPPED = ("T", "t")
"""States of a process that cannot run at all (stopped by a signal or a tracer)."""


def still_frozen(found: list[FrozenRank], grace: float) -> list[FrozenRank]:
    """The frozen ranks that do not end by themselves within ``grace`` seconds. A stopped
    process cannot; one blocked in C with the GIL held can: its own faulthandler fallback
    (``stacks.FrozenDump``, due a little after its peers' verdict) dumps its stacks and ends
    it, and that dump is worth the wait."""
    waiting = [f for f in found if f.state not in STOPPED]
    deadline = time.monotonic() + grace
    while waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        waiting = [f for f in waiting if process_state(f.pid) is not None]
    return [f for f in found if f.state in STOPPED or f in waiting]


REPORTER_FIRST_S = 2.0
"""Seconds a survivor that does not write the report waits for the frozen rank to be ended
by the one that does: the first to send SIGKILL leaves the others a zombie to look at, and
the report would no longer say "frozen" (several survivors on one host, 7 on a node of 8)."""


def gone_within(frozen: FrozenRank, seconds: float) -> bool:
    """Whether the frozen rank's process ends (another survivor's SIGKILL) within
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while process_state(frozen.pid) is not None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def end(frozen: FrozenRank) -> bool:
    """SIGKILL the frozen rank's process (the one signal a stopped process cannot defer);
    False when it was gone already or is not ours to end."""
    try:
        os.kill(frozen.pid, signal.SIGKILL)
    except OSError as exc:  # ended since, or another user's process
        logger.debug("trainguard watchdog: rank %d not ended: %s", frozen.rank, exc)
        return False
    return True


def write_note(path: Path, frozen: FrozenRank, by: int) -> None:
    """Where the frozen rank's stack dump would be: what was known of it (it wrote none).
    Left alone when that file exists already (another survivor wrote it, or the rank did)."""
    if path.exists() and path.stat().st_size > 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"trainguard: no stack dump from rank {frozen.rank}: {frozen.describe()}. "
        f"Rank {by} on the same host ended it with SIGKILL so that the job ends now (a "
        "launcher's SIGTERM cannot end a frozen process).\n"
    )
