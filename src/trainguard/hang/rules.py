"""What counts as a hang or a peer failure, and which ranks are the culprits. Pure functions.

* **Peer failure**: a registered, running rank whose heartbeat counter has not changed for
  ``dead_after`` seconds (its process died, or its interpreter is frozen so its watchdog
  thread cannot run), or a rank that published its own exception.
* **Hang**: no rank that is still training made progress for the timeout (the largest
  timeout any rank publishes), unless a rank is in a user phase (``guard.phase(...)``) or
  every rank has finished its loop (``done``: between ``watch()`` loops or after the last).
  Neither excuses a deadlock (``phase_deadlock``): a rank in a phase, or outside its loop,
  waiting in a collective while every other rank waits in another is a hang, its culprit
  the rank in the phase (between loops: the mismatch's own culprits).
* **Culprits of a hang**: the ranks furthest behind, ordered by ``(step, phase)`` with
  ``init = done < data < step < check`` (a rank stuck fetching data at step 5 is behind
  ranks waiting in step 5's check; a rank still between two loops, or one that broke out of
  its loop early, is behind ranks already in the next step, whatever the others' collective
  records say: only theirs are compared). When every training rank is at the same place,
  the culprits are the ranks that already closed or failed (the others wait for them) or,
  failing that, every rank: nobody is behind, so nobody can be singled out.
* **Collective mismatch** (``mismatch.find_mismatch``): when the stalled ranks' collective
  records (published with their heartbeats) disagree, the culprits are the ranks that never
  entered the collective the others wait in, else the ranks in the minority collective; the
  reason then says it in one line ("collective mismatch: rank 0 waits in barrier (train.py:19)
  while ranks 1-3 wait in DDP's gradient all_reduce (train.py:22)").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch.distributed as dist

from trainguard.errors import NonFiniteError, PeerFailureError, ReplicaDivergenceError
from trainguard.hang.collective_record import CollectiveRecord
from trainguard.hang.heartbeat import RankView
from trainguard.hang.mismatch import BEHIND, Mismatch, find_mismatch

HANG = "hang"
PEER_FAILURE = "peer_failure"

RECORD_WAIT_S = 10.0
"""At most this long past the timeout a hang waits for the collectives of stalled ranks that
have not published theirs while others have."""

PHASE_ORDER = {"absent": -1, "init": 0, "done": 0, "data": 1, "step": 2, "check": 3}
"""Position inside a step; phases not listed (user phases) count as ``step``."""


_COMM_MARKERS = (
    "gloo",
    "nccl",
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "processgroup",
    "socket timeout",
)


@dataclass(frozen=True)
class Verdict:
    """A decision every rank acts on: which kind, whom to blame, and who writes the report."""

    kind: str
    culprits: list[int]
    reason: str
    by: int = -1
    """The rank that decided it."""
    reporter: int = -1
    """The rank that writes ``report.json``."""
    silent: list[int] = field(default_factory=list)
    """Ranks that will not acknowledge the verdict (dead, frozen or failing)."""

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def decode(raw: bytes | str) -> Verdict | None:
        if not raw:
            return None
        try:
            data: Any = json.loads(raw)
            return Verdict(**data)
        except (ValueError, TypeError):
            return None


def position(view: RankView) -> tuple[int, int]:
    return (view.step, PHASE_ORDER.get(view.phase, PHASE_ORDER["step"]))


def pick_culprits(views: Sequence[RankView]) -> list[int]:
    """The ranks to blame for a hang (see the module docstring)."""
    training = [v for v in views if v.state == "running"]
    if not training:
        return []
    lowest = min(position(v) for v in training)
    behind = sorted(v.rank for v in training if position(v) == lowest)
    if len(behind) < len(training):
        return behind
    gone = sorted(v.rank for v in views if v.state in ("closed", "failed"))
    return gone or behind


def stopped_ranks(views: Sequence[RankView], me: int, dead_after: float) -> list[int]:
    """Running peers whose heartbeats stopped for ``dead_after`` seconds."""
    return sorted(
        v.rank
        for v in views
        if v.rank != me and v.registered and v.state == "running" and v.heartbeat_age >= dead_after
    )


def effective_timeout(views: Sequence[RankView], timeout: float) -> float:
    """The largest timeout of any running rank (the most patient one decides)."""
    published = [v.timeout for v in views if v.registered and v.state == "running"]
    return max([timeout, *published])


def detection_suspended(views: Sequence[RankView]) -> bool:
    """A user phase runs somewhere, or every rank finished its loop: no hang is declared
    (but see ``phase_deadlock``)."""
    training = [v for v in views if v.state == "running"]
    if any(v.registered and v.user_phase for v in training):
        return True
    return bool(training) and all(v.registered and v.phase == "done" for v in training)


def phase_deadlock(views: Sequence[RankView]) -> Mismatch | None:
    """What no phase excuses: a rank in a user phase, or outside its loop (``done``: every
    rank between two ``watch()`` loops), waits in a collective and every other training rank
    waits in another one (ops or sizes differ: a lone ``barrier`` in a rank-0 checkpoint
    while the others wait in the next step's all-reduce, or in an all-reduce of their own
    evaluation after the epoch). Each waits for a collective that can never start. None
    while any rank works outside a collective (a long evaluation: the phase may still end)
    or the collectives agree. The culprits are the paused ranks on the mismatch's sides
    (the mismatch's own culprits when every side is paused)."""
    training = [v for v in views if v.state == "running"]
    paused = {v.rank for v in training if v.registered and (v.user_phase or v.phase == "done")}
    if not paused:
        return None
    records = collective_records(views)
    if any(v.rank not in records or records[v.rank].op is None for v in training):
        return None
    if len(paused) == len(training) and any(r.seq is None for r in records.values()):
        # Every rank paused (between loops, or all in a phase): none is known to be stuck,
        # they may all still be working (an evaluation's collectives), so the records, read
        # at different moments, are compared only by sequence id (torch's flight recorder),
        # never by the stacks alone (rank 0 seen in a barrier and rank 1 a moment later in
        # the all-reduce after it is no deadlock).
        return None
    mismatch = find_mismatch(records)
    if mismatch is None or mismatch.kind == BEHIND:
        return None
    sides = {r for side in mismatch.sides for r in side.ranks}
    culprits = sorted(paused & sides)
    if not culprits or set(culprits) == sides:
        return mismatch
    return replace(mismatch, culprits=culprits)


def assess(views: Sequence[RankView], me: int, timeout: float, dead_after: float) -> Verdict | None:
    """A verdict when the views show a dead peer or a hang, else None."""
    stopped = stopped_ranks(views, me, dead_after)
    if stopped:
        ages = ", ".join(
            f"rank {v.rank} {v.heartbeat_age:.1f}s" for v in views if v.rank in stopped
        )
        reason = (
            f"heartbeats stopped ({ages} without a heartbeat): the process died or its "
            "interpreter is frozen"
        )
        return Verdict(PEER_FAILURE, stopped, reason, by=me, reporter=me, silent=stopped)
    suspended = detection_suspended(views)
    deadlock = phase_deadlock(views) if suspended else None
    if suspended and deadlock is None:
        return None
    training = [v for v in views if v.state == "running"]
    if not training:
        return None
    limit = effective_timeout(views, timeout)
    if not all(v.progress_age >= limit for v in training):
        return None
    if deadlock is not None:
        culprits = deadlock.culprits
        reason = f"{paused_where(views, culprits)}, {deadlock.line()}"
    elif records_pending(training, limit):
        return None
    else:
        culprits, reason = hang_culprits(views)
        mismatch = collective_mismatch(views)
        if mismatch is None or mismatch.kind == BEHIND:  # a phase cannot fix a mismatch
            reason += phase_hint(views, culprits)
    # no dump to wait for from a rank that never registered or whose watchdog stopped
    absent = [v.rank for v in views if not v.registered or v.state in ("closed", "failed")]
    reason = f"no rank made progress for {limit:g}s; {reason}"
    return Verdict(HANG, culprits, reason, by=me, reporter=me, silent=absent)


def phase_hint(views: Sequence[RankView], culprits: Sequence[int]) -> str:
    """What to do when the culprits were busy on purpose: ranks that stalled the others
    outside a user phase and outside their data loading (an evaluation or a checkpoint on
    one rank looks like this until it is marked). Not said of a collective mismatch (a
    phase does not excuse a deadlock: ``assess``), nor when no other rank waited."""
    busy = [
        v.rank
        for v in views
        if v.rank in culprits and not v.user_phase and v.phase not in ("data", "absent")
    ]
    waiting = [v for v in views if v.state == "running" and v.rank not in culprits]
    if not busy or not waiting:  # no other rank waited for them
        return ""
    ranks = ", ".join(map(str, busy))
    return (
        f"; if rank {ranks} was busy on purpose while the others waited (an evaluation or a "
        'checkpoint on one rank), wrap that work in `with guard.phase("eval"):` (docs/hangs.md)'
    )


def records_pending(training: Sequence[RankView], limit: float) -> bool:
    """Some stalled ranks published their collective and others not yet (a starved
    watchdog thread, a slow first read): wait for them, at most ``RECORD_WAIT_S`` or half
    the timeout past it. Ranks outside the loop publish none (in a user phase, one only
    while it waits in a collective: not expected)."""
    expected = [
        v for v in training if v.registered and not v.user_phase and v.phase not in ("init", "done")
    ]
    missing = [v for v in expected if v.collective is None]
    if not missing or len(missing) == len(expected):
        return False
    waited = min(v.progress_age for v in training) - limit
    return waited < min(limit / 2.0, RECORD_WAIT_S)


def paused_where(views: Sequence[RankView], culprits: Sequence[int]) -> str:
    """Where a deadlock's culprits paused: in a user phase, or outside the training loop."""
    if any(v.user_phase for v in views if v.rank in culprits):
        return "in a user phase"
    return "outside the training loop"


def hang_culprits(views: Sequence[RankView]) -> tuple[list[int], str]:
    """The culprits of a hang and why: the ranks furthest behind when some are outside
    their loop (the others' collectives are compared among themselves), else a collective
    mismatch when the records show one, else the ranks furthest behind."""
    outside = outside_the_loop(views)
    in_loop = [v for v in views if v.phase not in ("init", "done")] if outside else views
    mismatch = collective_mismatch(in_loop)
    if mismatch is not None and mismatch.kind != BEHIND and not outside:
        return mismatch.culprits, mismatch.line()
    culprits = pick_culprits(views) if mismatch is None or outside else mismatch.culprits
    where = "; ".join(
        f"rank {v.rank} at step {v.step} in {v.phase!r}" for v in views if v.rank in culprits
    )
    reason = f"behind: {where}"
    if mismatch is None:
        return culprits, reason
    among = "among the ranks in their loop, " if outside else ""
    return culprits, f"{reason}; {among}{mismatch.line()}"


def outside_the_loop(views: Sequence[RankView]) -> bool:
    """Some training ranks are outside their loop (``init``/``done``: a rank that broke out
    early, one still between two loops) while others are inside it."""
    training = [v for v in views if v.state == "running" and v.registered]
    outside = [v for v in training if v.phase in ("init", "done")]
    return bool(outside) and len(outside) < len(training)


def collective_records(views: Sequence[RankView]) -> dict[int, CollectiveRecord]:
    """The readable collective records of the running ranks."""
    records: dict[int, CollectiveRecord] = {}
    for view in views:
        record = CollectiveRecord.from_dict(view.collective)
        if record is not None and view.registered and view.state == "running":
            records[view.rank] = record
    return records


def collective_mismatch(views: Sequence[RankView]) -> Mismatch | None:
    return find_mismatch(collective_records(views))


def failure_verdict(rank: int, members: Sequence[int], exc: BaseException) -> Verdict:
    """The verdict a rank publishes about its own exception."""
    message = f"rank {rank} failed: {type(exc).__name__}: {exc}"
    if len(message) > 2000:
        message = message[:2000] + "..."
    others = [r for r in members if r != rank]
    reporter = min(others) if others else rank
    return Verdict(PEER_FAILURE, [rank], message, by=rank, reporter=reporter, silent=[rank])


def own_failure(kind: object, culprits: object, decided_by: object) -> bool:
    """Whether a verdict (or a ``report.json``'s ``kind``, ``culprits``, ``decided_by``) is a
    peer failure its culprit published itself (``failure_verdict``: its own exception), not
    a rank that died, froze or left without a word (another rank decided those)."""
    return kind == PEER_FAILURE and isinstance(culprits, list) and decided_by in culprits


def left_verdict(rank: int, left: Sequence[int], exc: BaseException) -> Verdict:
    """The verdict of a rank whose collective broke because ``left`` closed their guards
    mid-run (a ``sys.exit``, Ctrl-C or an exception outside the guard on another host):
    they are the culprits, not this rank."""
    message = (
        f"ranks {list(left)} left the job (their guard closed: sys.exit, Ctrl-C or an "
        f"exception the guard did not see) while rank {rank} waited in a collective "
        f"({type(exc).__name__}: {exc})"
    )[:2000]
    return Verdict(PEER_FAILURE, list(left), message, by=rank, reporter=rank, silent=list(left))


EVERY_RANK_ERRORS = (NonFiniteError, ReplicaDivergenceError)
"""Raised on every rank at the same step by design (an agreed decision): no rank's own news."""


def should_publish(exc: BaseException) -> bool:
    """Whether a rank's exception is news for the other ranks.

    Not ``EVERY_RANK_ERRORS`` (``NonFiniteError`` and its kin, ``ReplicaDivergenceError``:
    raised on every rank at the same step; an exception marked ``every_rank``), not
    ``PeerFailureError`` (the rank stops because
    of another rank), not ``KeyboardInterrupt`` / ``SystemExit``."""
    if getattr(exc, "every_rank", False):  # e.g. the guard's Join error (step/join.py)
        return False
    return isinstance(exc, Exception) and not isinstance(
        exc, (*EVERY_RANK_ERRORS, PeerFailureError)
    )


def is_comm_error(exc: BaseException) -> bool:
    """An error from a collective or the store: likely a symptom of another rank's failure."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _COMM_MARKERS)
