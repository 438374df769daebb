"""Hangs and dead ranks, end to end: real processes, gloo, the job's own c10d store.

Each test checks the cross-rank outcome: every rank's exit code, the report's kind, culprits
and phase, the stack files, the events, and how long after the fault every rank was gone.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import free_port, run_ranks
from tg_models import TinyNet, loss_fn, make_batches

import trainguard as tg

WORKER = Path(__file__).parent / "scripts" / "tg_worker.py"
SLACK_S = 10.0
"""The issue's bound: every rank is gone within hang_timeout + 10 s of the fault."""


def only_report(run_dir: Path) -> dict[str, Any]:
    reports = sorted((run_dir / "hangs").glob("*/report.json"))
    assert len(reports) == 1, reports
    report: dict[str, Any] = json.loads(reports[0].read_text())
    assert (reports[0].parent / "report.txt").exists()
    return report


def event_kinds(run_dir: Path, rank: int) -> list[str]:
    return [e["kind"] for e in tg.read_events(run_dir, rank)]


def unix_time_in(path: Path) -> float:
    return float(path.read_text())


# -- a rank blocks forever in its data loader -------------------------------------------------


def block_forever_in_loader() -> None:
    threading.Event().wait()


def stalling_loader(rank: int, run_dir: str, stall_rank: int, stall_at: int) -> Iterator[Any]:
    for index, batch in enumerate(make_batches(100, seed=rank)):
        if rank == stall_rank and index == stall_at:
            Path(run_dir, "stalled").write_text(repr(time.time()))
            block_forever_in_loader()
        yield batch


def train_until_stall(rank: int, world_size: int, run_dir: str, timeout: float) -> str:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=timeout) as guard:
        for batch in guard.watch(stalling_loader(rank, run_dir, stall_rank=2, stall_at=4)):
            loss = loss_fn(model, batch)
            loss.backward()
            guard.step(loss)
            time.sleep(0.02)
    return "finished"


@pytest.mark.timeout(90)
def test_rank_stuck_in_data_loader_ends_every_rank_with_a_hang_report(tmp_path: Path) -> None:
    timeout = 3.0
    results = run_ranks(train_until_stall, 4, str(tmp_path), timeout, timeout=75)
    gone = time.time()

    assert [r.exitcode for r in results] == [tg.EXIT_HANG] * 4
    elapsed = gone - unix_time_in(tmp_path / "stalled")
    assert timeout <= elapsed < timeout + SLACK_S
    report = only_report(tmp_path)
    assert report["kind"] == "hang"
    assert report["culprits"] == [2]
    assert report["exit_code"] == tg.EXIT_HANG
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[2]["phase"] == "data"
    assert {ranks[r]["phase"] for r in (0, 1, 3)} == {"check"}
    assert all(r["heartbeat_age"] < timeout for r in ranks.values())
    assert all(r["progress_age"] >= timeout for r in ranks.values())
    folder = tmp_path / "hangs" / report["id"]
    assert "block_forever_in_loader" in (folder / "rank-2.txt").read_text()
    for rank in range(4):
        assert (folder / f"rank-{rank}.txt").stat().st_size > 0
        kinds = event_kinds(tmp_path, rank)
        assert "watchdog" in kinds and "hang" in kinds


# -- rank 0 raises inside the loop ------------------------------------------------------------


def train_then_raise(rank: int, world_size: int, run_dir: str) -> str:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=30) as guard:
        for batch in guard.watch(make_batches(100, seed=rank)):
            loss = loss_fn(model, batch)
            loss.backward()
            if rank == 0 and guard.state.step == 3:
                Path(run_dir, "raised").write_text(repr(time.time()))
                raise RuntimeError("boom at step 3")
            guard.step(loss)
    return "finished"


@pytest.mark.timeout(90)
def test_exception_on_one_rank_ends_the_others_at_once_with_its_reason(tmp_path: Path) -> None:
    results = run_ranks(train_then_raise, 4, str(tmp_path), timeout=75)
    gone = time.time()

    assert results[0].error_type == "RuntimeError"
    assert [r.exitcode for r in results[1:]] == [tg.EXIT_PEER_FAILURE] * 3
    assert gone - unix_time_in(tmp_path / "raised") < 6.0  # the timeout is 30 s
    report = only_report(tmp_path)
    assert report["kind"] == "peer_failure"
    assert report["culprits"] == [0]
    assert "rank 0 failed: RuntimeError: boom at step 3" in report["reason"]
    assert report["reporter"] == 1
    assert "failure_published" in event_kinds(tmp_path, 0)
    for rank in (1, 2, 3):
        events = [e for e in tg.read_events(tmp_path, rank) if e["kind"] == "peer_failure"]
        assert len(events) == 1 and events[0]["culprits"] == [0]
        assert "boom at step 3" in events[0]["reason"]


# -- no false positive ------------------------------------------------------------------------


def irregular_healthy_run(rank: int, world_size: int, run_dir: str, timeout: float) -> int:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    pauses = [0.0, 1.0, 0.1, 0.9, 0.0, 1.0, 0.4, 0.0, 0.8, 0.2] if rank == 1 else [0.3, 0.0] * 5
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=timeout) as guard:
        for batch in guard.watch(make_batches(10, seed=rank)):
            loss = loss_fn(model, batch)
            loss.backward()
            guard.step(loss)
            time.sleep(pauses[guard.state.step - 1])
            if guard.state.step == 5:
                if rank == 0:  # only rank 0 evaluates; the others wait in a barrier
                    with guard.phase("eval"):
                        time.sleep(2.0 * timeout)
                dist.barrier()
            if guard.state.step == 8:
                if rank == 0:  # an evaluation through the model, unmarked: its forwards
                    _evaluate(model, seconds=2.0 * timeout)  # are progress
                dist.barrier()
        time.sleep(timeout + 0.5)  # after the loop, before close(): the loop is done
        return guard.state.step


def _evaluate(model: torch.nn.Module, seconds: float) -> None:
    model.eval()
    end = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < end:
            model(make_batches(1, seed=9)[0])
            time.sleep(0.2)
    model.train()


@pytest.mark.timeout(90)
def test_irregular_steps_and_a_long_eval_are_not_a_hang(tmp_path: Path) -> None:
    timeout = 3.0
    results = run_ranks(irregular_healthy_run, 2, str(tmp_path), timeout, timeout=75)

    assert [(r.exitcode, r.error_type, r.value) for r in results] == [(0, None, 10)] * 2
    assert not (tmp_path / "hangs").exists()
    for rank in range(2):
        kinds = event_kinds(tmp_path, rank)
        assert "hang" not in kinds and "peer_failure" not in kinds
        assert kinds.count("watchdog") == 1 and kinds.count("watchdog_stop") == 1


# -- a main thread frozen in C code that holds the GIL ----------------------------------------


def hold_gil_in_c(seconds: int) -> None:
    ctypes.PyDLL(None).sleep(seconds)  # PyDLL keeps the GIL during the call


def train_then_freeze(rank: int, world_size: int, run_dir: str, timeout: float) -> str:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=timeout) as guard:
        for batch in guard.watch(make_batches(100, seed=rank)):
            loss = loss_fn(model, batch)
            loss.backward()
            if rank == 1 and guard.state.step == 3:
                Path(run_dir, "frozen").write_text(repr(time.time()))
                hold_gil_in_c(60)
            guard.step(loss)
    return "finished"


@pytest.mark.timeout(90)
def test_main_thread_holding_the_gil_in_c_still_gets_a_stack_dump(tmp_path: Path) -> None:
    timeout = 3.0
    results = run_ranks(train_then_freeze, 2, str(tmp_path), timeout, timeout=75)
    gone = time.time()

    assert results[0].exitcode == tg.EXIT_PEER_FAILURE
    assert results[1].exitcode == 1  # faulthandler's exit after its dump
    assert gone - unix_time_in(tmp_path / "frozen") < timeout + SLACK_S
    report = only_report(tmp_path)
    assert report["kind"] == "peer_failure"
    assert report["culprits"] == [1]
    assert "heartbeats stopped" in report["reason"]
    dump = (tmp_path / "hangs" / report["id"] / "rank-1.txt").read_text()
    assert "hold_gil_in_c" in dump
    assert "train_then_freeze" in dump


# -- ranks as separate processes (as on separate hosts); one is SIGKILLed -------------------


def launch(world_size: int, run_dir: Path, *args: str) -> list[subprocess.Popen[bytes]]:
    port = str(free_port())
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        with open(logs / f"rank-{rank}.log", "wb") as log:
            cmd = [sys.executable, str(WORKER), str(run_dir), *args]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_for_step(path: Path, step: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        if path.exists() and int(path.read_text() or 0) >= step:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not reach step {step}")


def wait_all(procs: list[subprocess.Popen[bytes]], deadline: float) -> list[float]:
    """Each process's exit time (unix), polling every 50 ms; kills leftovers at the deadline."""
    gone: dict[int, float] = {}
    try:
        while len(gone) < len(procs) and time.monotonic() < deadline:
            for i, proc in enumerate(procs):
                if i not in gone and proc.poll() is not None:
                    gone[i] = time.time()
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert len(gone) == len(procs), f"ranks {sorted(set(range(len(procs))) - set(gone))} hung"
    return [gone[i] for i in range(len(procs))]


@pytest.mark.timeout(90)
def test_sigkilled_rank_is_reported_by_the_survivors(tmp_path: Path) -> None:
    timeout = 3.0
    procs = launch(4, tmp_path, "--timeout", str(timeout), "--steps", "5000")
    deadline = time.monotonic() + 75
    wait_for_step(tmp_path / "progress-rank1", 5, deadline)
    killed = time.time()
    procs[1].send_signal(signal.SIGKILL)
    exits = wait_all(procs, deadline)

    codes = [p.returncode for p in procs]
    assert codes == [
        tg.EXIT_PEER_FAILURE,
        -signal.SIGKILL,
        tg.EXIT_PEER_FAILURE,
        tg.EXIT_PEER_FAILURE,
    ]
    assert max(exits) - killed < timeout + SLACK_S
    report = only_report(tmp_path)
    assert report["kind"] == "peer_failure"
    assert report["culprits"] == [1]
    assert "heartbeats stopped" in report["reason"]
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[1]["heartbeat_age"] >= timeout
    for rank in (0, 2, 3):
        assert "peer_failure" in event_kinds(tmp_path, rank)
    # a survivor whose collective broke under it says so (its stack shows only the failure
    # handling): its comm_error event and its stack file's header name the loop's line
    broke = [r for r in (0, 2, 3) if "comm_error" in event_kinds(tmp_path, r)]
    assert broke, "the killed rank's peers were in the step's all-reduce with it"
    for rank in broke:
        header = (tmp_path / "hangs" / report["id"] / f"rank-{rank}.txt").read_text()[:3000]
        assert "this rank's collective failed under it: " in header
        assert "tg_worker.py:" in header


@pytest.mark.timeout(90)
def test_a_frozen_rank_is_named_frozen_and_the_job_ends_in_seconds(tmp_path: Path) -> None:
    """A SIGSTOPped rank cannot run its watchdog, handle a launcher's SIGTERM or write its
    stacks: a survivor on its host ends it with SIGKILL, so every process is gone within the
    hang timeout + 10 s, and the report, its events and its stack file say "frozen"."""
    timeout = 3.0
    procs = launch(3, tmp_path, "--timeout", str(timeout), "--steps", "5000")
    deadline = time.monotonic() + 75
    wait_for_step(tmp_path / "progress-rank1", 5, deadline)
    stopped = time.time()
    procs[1].send_signal(signal.SIGSTOP)
    try:
        exits = wait_all(procs, deadline)
    finally:
        if procs[1].poll() is None:
            procs[1].send_signal(signal.SIGCONT)
    assert [p.returncode for p in procs] == [
        tg.EXIT_PEER_FAILURE,
        -signal.SIGKILL,
        tg.EXIT_PEER_FAILURE,
    ]
    assert max(exits) - stopped < timeout + SLACK_S
    report = only_report(tmp_path)
    assert report["kind"] == "peer_failure" and report["culprits"] == [1]
    assert "rank 1 is frozen: its process" in report["reason"]
    assert "stopped (SIGSTOP" in report["reason"]
    note = (tmp_path / "hangs" / report["id"] / "rank-1.txt").read_text()
    assert "no stack dump from rank 1: rank 1 is frozen" in note
    frozen = [e for r in (0, 2) for e in tg.read_events(tmp_path, r) if e["kind"] == "frozen_rank"]
    assert frozen and {(e["rank"], e["process_state"]) for e in frozen} == {(1, "T")}
    text = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "frozen" in text and "ended before it could write one" not in text


@pytest.mark.timeout(90)
def test_a_sigkilled_watcher_is_reported_by_the_other_watcher(tmp_path: Path) -> None:
    """Ranks 0 and 2 read every heartbeat (the watchers of 4 ranks), ranks 1 and 3 only
    theirs. Watcher 2 is killed: watcher 0 names it and every survivor exits 92 (the test
    above kills non-watcher 1)."""
    timeout = 3.0
    procs = launch(4, tmp_path, "--timeout", str(timeout), "--steps", "5000")
    deadline = time.monotonic() + 75
    wait_for_step(tmp_path / "progress-rank2", 5, deadline)
    killed = time.time()
    procs[2].send_signal(signal.SIGKILL)
    exits = wait_all(procs, deadline)

    codes = [p.returncode for p in procs]
    assert codes == [
        tg.EXIT_PEER_FAILURE,
        tg.EXIT_PEER_FAILURE,
        -signal.SIGKILL,
        tg.EXIT_PEER_FAILURE,
    ]
    assert max(exits) - killed < timeout + SLACK_S
    report = only_report(tmp_path)
    assert report["kind"] == "peer_failure" and report["culprits"] == [2]
    assert report["decided_by"] == report["reporter"] == 0
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[2]["heartbeat_age"] >= timeout
    assert all(ranks[r]["heartbeat_age"] < timeout for r in (0, 1, 3))
    assert [ranks[r]["state"] for r in range(4)] == ["running", "running", "stopped", "running"]
    for rank in (0, 1, 3):
        events = tg.read_events(tmp_path, rank)
        assert [e["watchers"] for e in events if e["kind"] == "watchdog"] == [[0, 2]]
        failures = [e for e in events if e["kind"] == "peer_failure"]
        assert len(failures) == 1 and failures[0]["culprits"] == [2]


# -- torchrun names the rank that raised as the root cause ---------------------------------------


@pytest.mark.timeout(120)
def test_torchrun_names_the_rank_that_raised_not_a_peer(tmp_path: Path) -> None:
    """The peers wait for the failing process on their host to end before they exit with 92:
    torchrun's first observed failure is the rank that raised (exit 1), not a peer's 92 (a
    helper saw the peer named in 3 of 3 runs before)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(WORKER),
        str(tmp_path),
        "--timeout=10",
        "--steps=30",
        "--raise-rank=1",
        "--raise-step=3",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    log = done.stdout + done.stderr
    root = log.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : 1 " in root, log[-3000:]
    report = only_report(tmp_path)
    assert report["kind"] == "peer_failure" and report["culprits"] == [1]
    assert {r["rank"]: r["state"] for r in report["ranks"]}[1] == "failed"
    (failure,) = [e for e in tg.read_events(tmp_path, 0) if e["kind"] == "peer_failure"]
    assert failure["culprits"] == [1]  # written before rank 0 waited


# -- torchrun restarts a job that hung once ---------------------------------------------------


@pytest.mark.timeout(150)
def test_torchrun_restarts_after_a_hang_and_the_job_completes(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(WORKER),
        str(tmp_path),
        "--timeout=3",
        "--steps=8",
        "--stall-rank=1",
        "--stall-step=3",
        "--once",
    ]
    # Without it a restarted gloo group can read the previous attempt's addresses from the
    # store torchrun shares with the workers and fail to connect (pytorch/pytorch#135712).
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
            proc.wait()
    log = output.decode(errors="replace")

    assert proc.returncode == 0, log[-3000:]
    assert "exits with 91" in log
    for rank in range(2):
        finished = json.loads((tmp_path / f"done-rank{rank}").read_text())
        assert finished == {"attempt": 1, "steps": 8}
    report = only_report(tmp_path)
    assert report["kind"] == "hang"
    assert report["culprits"] == [1]
    assert {r["rank"]: r["phase"] for r in report["ranks"]}[1] == "data"
