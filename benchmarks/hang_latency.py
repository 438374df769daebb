"""Hang and dead-rank latency: from the fault to every rank having exited.

Four ranks run a small guarded training loop, each as its own process (as on separate
hosts: ``init_process_group("gloo")`` through ``env://``, rank 0's process serves the
TCPStore). Two faults, for each ``hang_timeout``:

* ``stall``: rank 2 blocks forever inside its data loader (it notes the time first);
* ``kill``: the benchmark SIGKILLs rank 1 once it has reached the fault step.

Per run: ``detect`` = the first ``hang`` / ``peer_failure`` event of any rank minus the
fault time; ``all_exited`` = the last rank's exit (polled every 20 ms) minus the fault time;
``after_detect`` = their difference (dumping stacks, the report, the exit); ``over_timeout``
= ``all_exited - hang_timeout``. All times are unix times of one host, so they compare.

    python benchmarks/hang_latency.py                       # timeouts 2, 5, 10 s; 3 runs each
    python benchmarks/hang_latency.py --timeouts 3 --runs 1
    python benchmarks/hang_latency.py --quick               # one 2 s run of each fault
    python benchmarks/hang_latency.py --update-docs docs/hangs.md

Prints a markdown table, writes JSON (``--out``, default ``runs/benchmarks/hang_latency.json``)
and, with ``--update-docs``, replaces the ``hang-latency`` block of the page.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, markdown_table, median, now_iso, replace_block, write_json

import trainguard as tg

WORLD = 4
FAULT_STEP = 5
STALL_RANK = 2
KILL_RANK = 1
DOCS_BLOCK = "hang-latency"


# -- the worker (one rank) --------------------------------------------------------------------


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _batches(rank: int, run_dir: Path, stall: bool) -> Iterator[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    for index in range(100_000):
        if stall and rank == STALL_RANK and index == FAULT_STEP:
            _write_atomic(run_dir / "fault", repr(time.time()))
            threading.Event().wait()
        yield torch.randn(8, 32, generator=gen)


def worker(run_dir: Path, timeout: float, stall: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    progress = run_dir / f"progress-rank{rank}"
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=timeout) as guard:
        for batch in guard.watch(_batches(rank, run_dir, stall)):
            loss = model(batch).pow(2).mean()
            loss.backward()
            guard.step(loss)
            _write_atomic(progress, str(guard.state.step))
            time.sleep(0.01)


# -- the driver -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(run_dir: Path, timeout: float, fault: str) -> list[subprocess.Popen[bytes]]:
    port = str(_free_port())
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
        cmd = [sys.executable, __file__, "--worker", str(run_dir), "--timeouts", str(timeout)]
        if fault == "stall":
            cmd.append("--stall")
        with open(run_dir / f"rank-{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait_for(path: Path, step: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if int(path.read_text() or 0) >= step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise TimeoutError(f"{path} did not reach step {step}")


def _exit_times(procs: list[subprocess.Popen[bytes]], deadline: float) -> dict[int, float]:
    gone: dict[int, float] = {}
    while len(gone) < len(procs) and time.monotonic() < deadline:
        for rank, proc in enumerate(procs):
            if rank not in gone and proc.poll() is not None:
                gone[rank] = time.time()
        time.sleep(0.02)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return gone


def measure(timeout: float, fault: str) -> dict[str, Any]:
    """One run: launch, fault, wait for every rank to exit; times relative to the fault."""
    with tempfile.TemporaryDirectory(prefix="hang-latency-") as tmp:
        run_dir = Path(tmp)
        procs = _launch(run_dir, timeout, fault)
        deadline = time.monotonic() + 120 + timeout
        try:
            if fault == "kill":
                _wait_for(run_dir / f"progress-rank{KILL_RANK}", FAULT_STEP, deadline)
                fault_at = time.time()
                procs[KILL_RANK].send_signal(signal.SIGKILL)
            else:
                while not (run_dir / "fault").exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
                fault_at = float((run_dir / "fault").read_text())
        finally:
            gone = _exit_times(procs, deadline)
        expected = tg.EXIT_HANG if fault == "stall" else tg.EXIT_PEER_FAILURE
        codes = [p.returncode for p in procs]
        events = [e for e in tg.read_events(run_dir) if e["kind"] in ("hang", "peer_failure")]
        survivors = [r for r in range(WORLD) if not (fault == "kill" and r == KILL_RANK)]
        detect = min(e["time"] for e in events) - fault_at if events else None
        last = max(gone[r] for r in survivors) - fault_at if len(gone) == WORLD else None
        reports = [json.loads(p.read_text()) for p in run_dir.glob("hangs/*/report.json")]
        return {
            "timeout_s": timeout,
            "fault": fault,
            "exit_codes": codes,
            "ok": all(codes[r] == expected for r in survivors) and len(reports) == 1,
            "culprits": reports[0]["culprits"] if reports else None,
            "detect_s": detect,
            "all_exited_s": last,
            "after_detect_s": None if detect is None or last is None else last - detect,
            "over_timeout_s": None if last is None else last - timeout,
        }


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for key in sorted({(r["timeout_s"], r["fault"]) for r in runs}):
        group = [r for r in runs if (r["timeout_s"], r["fault"]) == key]
        good = [r for r in group if r["ok"] and r["all_exited_s"] is not None]

        def med(name: str, runs_: list[dict[str, Any]] = good) -> float | None:
            values = [r[name] for r in runs_ if r[name] is not None]
            return median(values) if values else None

        rows.append(
            {
                "timeout_s": key[0],
                "fault": key[1],
                "runs": len(group),
                "ok": len(good),
                "detect_s": med("detect_s"),
                "all_exited_s": med("all_exited_s"),
                "max_all_exited_s": max((r["all_exited_s"] for r in good), default=None),
                "after_detect_s": med("after_detect_s"),
                "over_timeout_s": med("over_timeout_s"),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "hang_timeout (s)",
        "fault",
        "runs ok",
        "detect (s)",
        "all exited (s)",
        "worst all exited (s)",
        "exit after detect (s)",
        "over timeout (s)",
    ]
    body = [
        [
            r["timeout_s"],
            r["fault"],
            f"{r['ok']}/{r['runs']}",
            r["detect_s"],
            r["all_exited_s"],
            r["max_all_exited_s"],
            r["after_detect_s"],
            r["over_timeout_s"],
        ]
        for r in rows
    ]
    return markdown_table(headers, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeouts", default="2,5,10", help="hang_timeout values, seconds")
    parser.add_argument("--faults", default="stall,kill")
    parser.add_argument("--runs", type=int, default=3, help="runs per timeout and fault")
    parser.add_argument("--quick", action="store_true", help="one 2 s run of each fault")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks/hang_latency.json"))
    parser.add_argument("--update-docs", type=Path, metavar="PAGE", help="e.g. docs/hangs.md")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stall", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, float(args.timeouts), args.stall)
        return
    timeouts = [2.0] if args.quick else [float(t) for t in args.timeouts.split(",")]
    runs_each = 1 if args.quick else args.runs
    faults = args.faults.split(",")
    runs = []
    for timeout in timeouts:
        for fault in faults:
            for i in range(runs_each):
                result = measure(timeout, fault)
                runs.append(result)
                print(
                    f"timeout {timeout:g}s {fault} run {i + 1}: exits {result['exit_codes']}, "
                    f"all exited after {result['all_exited_s']}",
                    file=sys.stderr,
                )
    rows = summarize(runs)
    text = table(rows)
    print(text)
    write_json(
        args.out,
        {"time": now_iso(), "machine": machine_info(), "world": WORLD, "rows": rows, "runs": runs},
    )
    print(f"wrote {args.out}", file=sys.stderr)
    if args.update_docs is not None:
        note = (
            f"{WORLD} ranks as separate processes on one machine ({machine_info()['cpu']}, "
            f"{machine_info()['cpus_available']} CPUs), gloo, medians of the runs; {now_iso()}."
        )
        replace_block(args.update_docs, DOCS_BLOCK, f"{text}\n\n{note}")
        print(f"updated {args.update_docs}", file=sys.stderr)


if __name__ == "__main__":
    main()
