"""How long from a hung or dead rank to every rank having exited, with a report?

``--world`` ranks (default 4) each run a small guarded training loop as a process of its
own (as on separate hosts: ``init_process_group("gloo")`` through ``env://``, rank 0's
process serves the TCPStore). Two faults, for each ``hang_timeout``:

* ``stall``: the last rank blocks forever inside its data loader (it notes the time first);
* ``kill``: the benchmark SIGKILLs rank 1 once it has reached the fault step.

Per run: ``detect`` = the first ``hang`` / ``peer_failure`` event of any rank minus the
fault time; ``all exited`` = the last surviving rank's exit (polled every 20 ms) minus the
fault time; ``exit after detect`` their difference (stack dumps, the report, the exit);
``over timeout`` = ``all exited - hang_timeout``. A run is ``ok`` when every survivor exited
with the documented code (``tg.EXIT_HANG`` 91, ``tg.EXIT_PEER_FAILURE`` 92) and one hang
report was written. The naive approach, the collective's own timeout, waits 30 minutes
(gloo) or 10 (NCCL) and names no rank. All on one host and its clock; the device does not
matter here (the watchdog runs on the host, over the job's c10d store).

    python benchmarks/hang_latency.py                     # timeouts 2, 5, 10 s; 3 runs each
    python benchmarks/hang_latency.py --timeouts 3 --rounds 1
    python benchmarks/hang_latency.py --quick             # 2 ranks, one 2 s run of each fault

``--parallel N`` runs N jobs at once (``--quick``: both faults at once): the machine is then
shared, so only for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    finish,
    finish_args,
    free_port,
    header,
    markdown_table,
    median,
    parser,
    quick_dns,
)

import trainguard as tg

NAME = "hang_latency"
FAULT_STEP = 5
KILL_RANK = 1


# -- one rank -----------------------------------------------------------------------------------


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _batches(rank: int, stall_rank: int, run_dir: Path) -> Iterator[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    for index in range(100_000):
        if rank == stall_rank and index == FAULT_STEP:
            _write_atomic(run_dir / "fault", repr(time.time()))
            threading.Event().wait()
        yield torch.randn(8, 32, generator=gen)


def worker(run_dir: Path, timeout: float, stall: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    progress = run_dir / f"progress-rank{rank}"
    stall_rank = world - 1 if stall else -1
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=timeout) as guard:
        for batch in guard.watch(_batches(rank, stall_rank, run_dir)):
            loss = model(batch).pow(2).mean()
            loss.backward()
            guard.step(loss)
            _write_atomic(progress, str(guard.state.step))
            time.sleep(0.01)


# -- the driver ---------------------------------------------------------------------------------


def _launch(run_dir: Path, world: int, timeout: float, fault: str) -> list[subprocess.Popen[bytes]]:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
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


def measure(world: int, timeout: float, fault: str) -> dict[str, Any]:
    """One run: launch, fault, wait for every rank to exit; times relative to the fault."""
    with tempfile.TemporaryDirectory(prefix="tg-hang-latency-") as tmp:
        run_dir = Path(tmp)
        procs = _launch(run_dir, world, timeout, fault)
        deadline = time.monotonic() + 120 + timeout
        fault_at = None
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
        survivors = [r for r in range(world) if not (fault == "kill" and r == KILL_RANK)]
        detect = min(e["time"] for e in events) - fault_at if events else None
        last = max(gone[r] for r in survivors) - fault_at if len(gone) == world else None
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

        def med(name: str, good: list[dict[str, Any]] = good) -> float | None:
            values = [r[name] for r in good if r[name] is not None]
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
    headers = ["hang_timeout (s)", "fault", "runs ok", "detect (s)", "all exited (s)"]
    headers += ["worst all exited (s)", "exit after detect (s)", "over timeout (s)"]
    body = [
        [r["timeout_s"], r["fault"], f"{r['ok']}/{r['runs']}", r["detect_s"], r["all_exited_s"],
         r["max_all_exited_s"], r["after_detect_s"], r["over_timeout_s"]]
        for r in rows
    ]  # fmt: skip
    return markdown_table(headers, body)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, rounds=3, quick_rounds=1, warmup=0, device=False)
    p.add_argument("--timeouts", default="2,5,10", help="hang_timeout values, seconds")
    p.add_argument("--faults", default="stall,kill")
    p.add_argument("--world", type=int, help="ranks (default 4; 2 with --quick)")
    p.add_argument("--parallel", type=int, help="jobs at once (default 1; all with --quick)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--stall", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, float(args.timeouts), args.stall)
        return 0
    finish_args(p, args, NAME)
    quick_dns()
    world = args.world or (2 if args.quick else 4)
    if world < 2:
        p.error("--world must be at least 2")
    timeouts = [2.0] if args.quick else [float(t) for t in args.timeouts.split(",")]
    faults = args.faults.split(",")
    jobs = [(t, f) for t in timeouts for f in faults for _ in range(args.rounds)]
    parallel = max(1, args.parallel or (len(jobs) if args.quick else 1))
    settings = {"world": world, "timeouts": timeouts, "faults": faults, "runs": args.rounds}
    report = header(NAME, argv, {**settings, "parallel": parallel})

    def run(job: tuple[float, str]) -> dict[str, Any]:
        result = measure(world, *job)
        print(
            f"timeout {job[0]:g} s, {job[1]}: exits {result['exit_codes']}, "
            f"all exited after {result['all_exited_s']}",
            file=sys.stderr,
        )
        return result

    with ThreadPoolExecutor(parallel) as pool:
        runs = list(pool.map(run, jobs))
    report["rows"] = summarize(runs)
    report["runs"] = runs
    print(table(report["rows"]))
    finish(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
