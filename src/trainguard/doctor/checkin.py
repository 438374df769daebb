"""Every rank checks in through the job's c10d store before any collective runs.

Each rank writes ``arrived/<rank>`` (its versions, variables and local findings) and bumps
``arrived_count``. Rank 0 waits, with its own deadline, until every rank has arrived, then
writes ``roster``: who is present, who never came, and how long after rank 0 each arrived.
The other ranks wait for the roster (a longer deadline: rank 0 may start late and then wait
itself). A rank that never shows up is named within the deadline, never by a hang in a
collective; a rank that comes after rank 0 gave up reads a roster that names itself.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainguard.doctor.findings import Finding

POLL_S = 0.05


class Store(Protocol):
    """The part of ``torch.distributed.Store`` the check-in uses."""

    def set(self, key: str, value: str) -> None: ...
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def get(self, key: str) -> bytes: ...


def arrived_key(rank: int) -> str:
    return f"arrived/{rank}"


@dataclass
class Roster:
    """Who came. ``payloads`` holds what each present rank published."""

    present: list[int]
    missing: list[int]
    payloads: dict[int, dict[str, Any]] = field(default_factory=dict)
    arrival_s: dict[int, float] = field(default_factory=dict)
    """Seconds after rank 0's own check-in that each rank was seen (rank 0's clock)."""
    closed_by: str = "rank 0"
    """"rank 0", or "timeout" when rank 0 never published the roster."""
    late: bool = False
    """This rank arrived after rank 0 had closed the roster."""


def check_in(
    store: Store, rank: int, world_size: int, payload: dict[str, Any], timeout_s: float
) -> Roster:
    store.set(arrived_key(rank), json.dumps(payload))
    store.add("arrived_count", 1)
    if rank == 0:
        roster = _collect(store, world_size, timeout_s)
        store.set("roster", json.dumps(_roster_json(roster)))
    else:
        roster = _await_roster(store, rank, world_size, 2 * timeout_s + 5.0)
    roster.payloads = {r: json.loads(store.get(arrived_key(r))) for r in roster.present}
    return roster


def _collect(store: Store, world_size: int, timeout_s: float) -> Roster:
    """Rank 0: wait until all arrived or the deadline; note when each one was seen."""
    start = time.monotonic()
    seen: dict[int, float] = {0: 0.0}
    waiting = [r for r in range(world_size) if r != 0]
    last_count = 1
    while waiting and time.monotonic() - start < timeout_s:
        count = store.add("arrived_count", 0)
        if count != last_count:
            last_count = count
            now = time.monotonic() - start
            for r in [r for r in waiting if store.check([arrived_key(r)])]:
                seen[r] = now
                waiting.remove(r)
        if waiting:
            time.sleep(POLL_S)
    present = sorted(seen)
    return Roster(present=present, missing=waiting, arrival_s=seen)


def _await_roster(store: Store, rank: int, world_size: int, timeout_s: float) -> Roster:
    deadline = time.monotonic() + timeout_s
    while not store.check(["roster"]):
        if time.monotonic() >= deadline:
            present = [r for r in range(world_size) if store.check([arrived_key(r)])]
            missing = [r for r in range(world_size) if r not in present]
            return Roster(present=present, missing=missing, closed_by="timeout")
        time.sleep(POLL_S)
    data = json.loads(store.get("roster"))
    arrival = {int(k): float(v) for k, v in data["arrival_s"].items()}
    return Roster(
        present=data["present"],
        missing=data["missing"],
        arrival_s=arrival,
        late=rank in data["missing"],
    )


def _roster_json(roster: Roster) -> dict[str, Any]:
    arrival = {str(r): round(s, 3) for r, s in roster.arrival_s.items()}
    return {"present": roster.present, "missing": roster.missing, "arrival_s": arrival}


CHECKIN = "ranks.checkin"
NOT_ARRIVED_FIX = (
    "look at that rank's own output: it did not start, crashed before the doctor ran, or "
    "cannot reach MASTER_ADDR:MASTER_PORT; raise --timeout if its host is only slow to start"
)


def roster_findings(roster: Roster, rank: int, timeout_s: float) -> list[Finding]:
    """What the roster means for this rank: every rank that never came is named."""
    if roster.late:
        message = (
            f"rank {rank} checked in after rank 0 had stopped waiting ({timeout_s:g} s): "
            "rank 0 reports it as missing"
        )
        return [Finding(CHECKIN, "fail", message, "find why this rank starts late", rank=rank)]
    findings: list[Finding] = []
    if roster.closed_by == "timeout":
        message = f"rank 0 never published the check-in roster within {2 * timeout_s + 5:g} s"
        findings.append(Finding(CHECKIN, "fail", message, NOT_ARRIVED_FIX, rank=0))
    for missing in roster.missing:
        if missing == 0 and roster.closed_by == "timeout":
            continue
        message = f"rank {missing} did not check in within {timeout_s:g} s"
        findings.append(Finding(CHECKIN, "fail", message, NOT_ARRIVED_FIX, rank=missing))
    if not findings:
        last = max(roster.arrival_s.items(), key=lambda item: item[1], default=(0, 0.0))
        message = (
            f"all {len(roster.present)} ranks checked in; the last, rank {last[0]}, "
            f"{last[1]:.2f} s after rank 0"
        )
        findings.append(Finding(CHECKIN, "ok", message))
    return findings
