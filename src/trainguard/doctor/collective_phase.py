"""The smoke test under a deadline, and every rank's results exchanged through the store.

The process group and the ops run in a worker thread; the main thread waits at most
``2 * timeout``. A worker still inside a collective then is abandoned: the report says which op
and which ranks are behind (from their ``progress/<rank>`` keys), and the process must end with
``os._exit`` after printing (a thread blocked in gloo or NCCL cannot be joined or destroyed).
Gloo's own timeout is ``timeout``, so a gloo op usually fails with its error before the
deadline; NCCL's is set past the deadline so that the report comes out before NCCL's watchdog
tears the process down.

Every rank then publishes its results (``result/<rank>``) and reads everyone's, so that every
rank draws the same findings from the same data.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, Store

from trainguard.doctor.checkin import POLL_S
from trainguard.doctor.findings import Finding
from trainguard.doctor.smoke import OpResult, run_ops

NCCL_TIMEOUT_MARGIN_S = 60.0


@dataclass
class Plan:
    rank: int
    world_size: int
    backend: str
    device: torch.device
    timeout_s: float
    bandwidth_bytes: int

    @property
    def deadline_s(self) -> float:
        return 2 * self.timeout_s


@dataclass
class Outcome:
    results: list[OpResult] = field(default_factory=list)
    stuck_in: str | None = None
    error: str | None = None
    initialized: bool = False


def run_bounded(store: Store, plan: Plan) -> Outcome:
    """Init the group and run the ops in a thread; give up on it after the deadline."""
    outcome = Outcome()
    where = {"op": "init_process_group"}
    clone = getattr(store, "clone", None)  # the worker's own connection (absent in stubs)
    worker_store: Store = clone() if clone is not None else store

    def progress(index: int, name: str) -> None:
        where["op"] = name
        worker_store.set(f"progress/{plan.rank}", f"{index}:{name}")

    def work() -> None:
        try:
            _init_group(store, plan)
            outcome.initialized = True
            outcome.results = run_ops(
                plan.rank, plan.world_size, plan.device, plan.bandwidth_bytes, progress
            )
        except Exception as exc:  # reported, not raised: the other ranks must hear of it
            outcome.error = f"{where['op']}: {_first_line(exc)}"

    progress(0, "init_process_group")
    thread = threading.Thread(target=work, name="trainguard-doctor-smoke", daemon=True)
    thread.start()
    thread.join(plan.deadline_s)
    if thread.is_alive():
        outcome.stuck_in = where["op"]
    return outcome


def _init_group(store: Store, plan: Plan) -> None:
    if plan.device.type == "cuda":
        torch.cuda.set_device(plan.device)
        pg_timeout = plan.deadline_s + NCCL_TIMEOUT_MARGIN_S
    else:
        pg_timeout = plan.timeout_s
    dist.init_process_group(
        plan.backend,
        store=PrefixStore("pg", store),
        rank=plan.rank,
        world_size=plan.world_size,
        timeout=timedelta(seconds=pg_timeout),
        device_id=plan.device if plan.device.type == "cuda" else None,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def outcome_json(outcome: Outcome) -> dict[str, Any]:
    return {
        "results": [r.to_dict() for r in outcome.results],
        "stuck_in": outcome.stuck_in,
        "error": outcome.error,
    }


def exchange(
    store: Store, rank: int, present: list[int], mine: dict[str, Any], timeout_s: float
) -> dict[int, dict[str, Any] | None]:
    """Publish this rank's outcome and read every present rank's (None: not within timeout)."""
    store.set(f"result/{rank}", json.dumps(mine))
    deadline = time.monotonic() + timeout_s
    waiting = [r for r in present if r != rank]
    while waiting and time.monotonic() < deadline:
        waiting = [r for r in waiting if not store.check([f"result/{r}"])]
        if waiting:
            time.sleep(POLL_S)
    return {r: None if r in waiting else json.loads(store.get(f"result/{r}")) for r in present}


def progress_of(store: Store, ranks: list[int]) -> dict[int, tuple[int, str] | None]:
    """Where each rank last was (index, op name); None when it never wrote its key."""
    where: dict[int, tuple[int, str] | None] = {}
    for r in ranks:
        key = f"progress/{r}"
        if not store.check([key]):
            where[r] = None
            continue
        index, _, name = store.get(key).decode().partition(":")
        where[r] = (int(index), name)
    return where


def stragglers(where: dict[int, tuple[int, str] | None]) -> Finding | None:
    """The ranks behind the furthest one, or None when all are at the same op."""
    reached = {r: (w[0] if w else -1) for r, w in where.items()}
    if not reached or len(set(reached.values())) == 1:
        return None
    front = max(reached.values())
    behind = sorted(r for r, i in reached.items() if i < front)
    ahead_at = next(w[1] for w in where.values() if w and w[0] == front)
    spots = ", ".join(f"rank {r} at {_op_name(where[r])}" for r in behind)
    message = f"ranks behind: {spots}, while the others reached {ahead_at}"
    fix = "look at those ranks first: a slow host, a stuck data loader, or a dead process"
    return Finding(
        "smoke.stragglers", "fail", message, fix, rank=behind[0] if len(behind) == 1 else None
    )


def _op_name(where: tuple[int, str] | None) -> str:
    return where[1] if where is not None else "nothing (never started)"
