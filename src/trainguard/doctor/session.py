"""The doctor's cross-rank part, under torchrun or any launcher that sets the variables.

1. Connect to the job's c10d store (torchrun's agent store, or the TCPStore rank 0 starts).
2. Check in (``checkin``): every rank that never shows up is named, within the timeout.
3. Compare every rank's versions and variables (``compare``).
4. Only when everyone came: the smoke test under a deadline (``collective_phase``), results
   exchanged so that every rank reaches the same verdict.
5. ``report.close()``, after the report is printed: every rank waits (bounded) until every
   rank has printed, so that no rank's exit cuts another's report short.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # the class torch.distributed re-exports
from torch.distributed.distributed_c10d import PrefixStore, Store

from trainguard.doctor import collective_phase
from trainguard.doctor.checkin import POLL_S, Roster, check_in, roster_findings
from trainguard.doctor.compare import compare_ranks
from trainguard.doctor.findings import DoctorReport, Finding
from trainguard.doctor.rendezvous import Launch
from trainguard.doctor.smoke_results import COLLECTIVES, smoke_findings, smoke_section

logger = logging.getLogger(__name__)

STORE_FIX = (
    "start rank 0 (it hosts the store) or check MASTER_ADDR/MASTER_PORT and the firewall "
    "between this host and rank 0's"
)


def namespace(env: dict[str, str] | os._Environ[str]) -> str:
    """One key space per run and restart: a store that outlives an attempt cannot mix them."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "manual")
    return f"trainguard-doctor/{run_id}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def connect_store(launch: Launch, timeout_s: float) -> Store:
    """The job's store: a client of torchrun's agent store, or rank 0's own TCPStore."""
    assert launch.master_addr is not None and launch.master_port is not None
    return TCPStore(
        host_name=launch.master_addr,
        port=launch.master_port,
        world_size=launch.world_size if launch.hosts_store else None,
        is_master=launch.hosts_store,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
    )


def run_session(
    report: DoctorReport,
    launch: Launch,
    payload: dict[str, Any],
    timeout_s: float,
    bandwidth_bytes: int,
) -> None:
    rank = launch.rank or 0
    try:
        store = PrefixStore(namespace(os.environ), connect_store(launch, timeout_s))
    except (RuntimeError, OSError) as exc:
        where = f"{launch.master_addr}:{launch.master_port}"
        message = f"cannot reach the store at {where}: {_first_line(exc)}"
        report.add(
            Finding(
                "ranks.store", "fail", message, STORE_FIX, rank=None if launch.agent_store else 0
            )
        )
        report.smoke = {"skipped": "the store is unreachable"}
        report.full_text = True
        return
    try:
        roster = check_in(store, rank, launch.world_size, payload, timeout_s)
        _record_roster(report, roster, rank, timeout_s)
        if roster.missing or roster.late:
            report.smoke = {"skipped": "not every rank checked in"}
        else:
            _smoke(report, store, launch, roster, timeout_s, bandwidth_bytes)
        report.closer = lambda: _finish(store, roster, timeout_s)
    except (RuntimeError, OSError) as exc:  # the store went away under us
        where = f"{launch.master_addr}:{launch.master_port}"
        message = f"the store at {where} stopped answering: {_first_line(exc)}"
        report.add(Finding("ranks.store", "fail", message, STORE_FIX))
        report.full_text = True


def _record_roster(report: DoctorReport, roster: Roster, rank: int, timeout_s: float) -> None:
    report.add(*roster_findings(roster, rank, timeout_s))
    if roster.late or roster.closed_by != "rank 0":
        report.full_text = True  # rank 0 may not print this rank's side
    report.ranks = [
        _rank_row(r, p, roster.arrival_s.get(r)) for r, p in sorted(roster.payloads.items())
    ]
    if len(roster.payloads) > 1:
        report.add(*compare_ranks(roster.payloads))
    for other, payload in sorted(roster.payloads.items()):
        if other != rank:
            for data in payload.get("findings", []):
                report.add(Finding.from_dict({**data, "rank": other}))


def _rank_row(rank: int, payload: dict[str, Any], arrival_s: float | None) -> dict[str, Any]:
    return {
        "rank": rank,
        "host": payload["versions"].get("host"),
        **{k: payload["versions"].get(k) for k in ("torch", "cuda", "nccl", "python", "driver")},
        "device": payload.get("device"),
        "arrival_s": arrival_s,
        "variables": payload["variables"],
    }


def agree_backend(payloads: dict[int, dict[str, Any]]) -> str:
    """NCCL only when every rank can run it; one answer on every rank, from the same data."""
    return "nccl" if all(p.get("nccl_ready") for p in payloads.values()) else "gloo"


def _smoke(
    report: DoctorReport,
    store: Store,
    launch: Launch,
    roster: Roster,
    timeout_s: float,
    bandwidth_bytes: int,
) -> None:
    rank = launch.rank or 0
    backend = agree_backend(roster.payloads)
    device = (
        torch.device("cuda", launch.local_rank or 0) if backend == "nccl" else torch.device("cpu")
    )
    plan = collective_phase.Plan(
        rank, launch.world_size, backend, device, timeout_s, bandwidth_bytes
    )
    # the others may post up to their own deadline: wait for that, plus the timeout
    results_until = time.monotonic() + plan.deadline_s + timeout_s
    outcome = collective_phase.run_bounded(store, plan)
    mine = collective_phase.outcome_json(outcome)
    wait_s = max(timeout_s, results_until - time.monotonic())
    outcomes = collective_phase.exchange(store, rank, roster.present, mine, wait_s)
    expected = [*COLLECTIVES, *(["bandwidth"] if bandwidth_bytes > 0 else [])]
    findings = smoke_findings(outcomes, timeout_s, expected)
    if any(f.status == "fail" for f in findings):
        where = collective_phase.progress_of(store, roster.present)
        behind = collective_phase.stragglers(where)
        if behind is not None:
            findings.append(behind)
    report.add(*findings)
    report.smoke = smoke_section(backend, str(device), outcomes)
    if outcome.stuck_in is not None:
        report.hard_exit = True  # a thread is inside a collective: no clean teardown possible
    elif outcome.initialized and dist.is_initialized():
        dist.destroy_process_group()


def _finish(store: Store, roster: Roster, timeout_s: float) -> None:
    """After this rank printed: count it out and wait (bounded) until every present rank has.

    torchrun ends the other workers as soon as one exits non-zero, and the rank that hosts the
    store takes it down when it exits: without this, a rank could lose its report to a faster
    one's exit."""
    try:
        store.add("printed", 1)
        deadline = time.monotonic() + timeout_s
        while store.add("printed", 0) < len(roster.present) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    except (RuntimeError, OSError):
        logger.debug("store gone while finishing", exc_info=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
