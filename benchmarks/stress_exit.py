"""Exit stress: does a finished 2-rank job always exit cleanly (status 0, no abort)?

Issue 15: 2-rank gloo DDP runs with the guard sometimes ended with ``terminate called
without an active exception`` (SIGABRT in one process) after training had finished, and
torchrun took that for a failed worker. This script runs the scenarios many times and counts
the abnormal exits (a non-zero status of the launcher or of a rank, a signal, or ``terminate
called`` on stderr), keeping the output of every failure.

Each run is a real job: ``python -m torch.distributed.run --standalone --nproc-per-node 2``
(``--launcher torchrun``, the default: the agent serves the store) or two plain processes
joined through ``env://`` (``--launcher plain``: rank 0's process serves the TCPStore), each
training the demo's classifier under DDP on gloo. Scenarios:

* ``capture``: the guard with the watchdog on (adaptive timeout), one batch of rank 1 makes a
  NaN, the step is skipped and captured; then ``python -m trainguard replay`` of the bundle
  (its exit status counts too);
* ``capture_nowd``: the same with ``hang_timeout=0`` (no watchdog);
* ``watchdog``: the guard with the watchdog on, no NaN, normal completion;
* ``bare``: the same loop without the guard (the control).

    python benchmarks/stress_exit.py                           # 50 runs of each scenario
    python benchmarks/stress_exit.py --runs 5 --scenarios capture,bare
    python benchmarks/stress_exit.py --launcher plain

Prints a markdown table and writes JSON (``--out``, default
``runs/benchmarks/stress_exit.json``) with every failure's exit statuses and stderr tail.
Not part of CI: 200 runs take several minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine_info, markdown_table, now_iso, write_json

SCENARIOS = ("capture", "capture_nowd", "watchdog", "bare")
WORLD = 2
STEPS = 10
ABORT_TEXT = "terminate called"
RUN_TIMEOUT_S = float(os.environ.get("STRESS_RUN_TIMEOUT_S", "120"))
EXPECTED = {"replay": 1}
"""Expected exit statuses other than 0: ``trainguard replay`` exits 1 when it reproduced the
non-finite step (a finding)."""


# -- the worker (one rank) --------------------------------------------------------------------


def worker(scenario: str, run_dir: Path, steps: int) -> None:
    """One rank of the job: the demo's classifier under DDP, guarded unless ``bare``.

    A rank still alive shortly before the driver's timeout writes every thread's Python stack
    to the job log (faulthandler), so a hung run says where it hung: in training, in the
    guard, or after ``worker`` returned (the destructors of its locals)."""
    import faulthandler

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainguard.demo import DemoData, DemoNet, RankBatches, balanced_loss

    faulthandler.dump_traceback_later(max(RUN_TIMEOUT_S - 10.0, 1.0), exit=False)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(DemoNet())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    nan = scenario != "watchdog"  # DemoData makes one batch of rank 1 lack a class: 0/0
    data = DemoData(steps, world) if nan else _all_classes(DemoData(steps, world))
    loader = torch.utils.data.DataLoader(data, batch_sampler=RankBatches(rank, world, steps))
    if scenario == "bare":
        for batch in loader:
            loss = balanced_loss(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            if torch.isfinite(loss).all():  # the same on every rank: DDP averaged the NaN
                optimizer.step()
            optimizer.zero_grad()
    else:
        _guarded(scenario, model, optimizer, loader, run_dir)
    dist.destroy_process_group()


def _guarded(scenario: str, model: Any, optimizer: Any, loader: Any, run_dir: Path) -> None:
    import trainguard as tg
    from trainguard.demo import balanced_loss

    hang_timeout = 0.0 if scenario == "capture_nowd" else None
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=hang_timeout) as guard:
        for batch in guard.watch(loader):
            loss = balanced_loss(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            if guard.check(loss):
                optimizer.step()
            optimizer.zero_grad()


def _all_classes(data: Any) -> Any:
    """The demo's data with every class in every batch (no NaN)."""
    import torch

    from trainguard.demo import CLASSES

    data.y = torch.arange(len(data.y)) % CLASSES
    return data


# -- the driver -------------------------------------------------------------------------------


@dataclass
class RunResult:
    scenario: str
    index: int
    ok: bool
    seconds: float
    statuses: dict[str, int | None]
    """Exit status per process (``launcher`` or ``rank-r``, ``replay``); negative: a signal."""
    aborted: bool
    """``terminate called`` appeared on stderr."""
    output_tail: str = ""
    """The last lines of the job's output (kept for failures only)."""


@dataclass
class ScenarioSummary:
    scenario: str
    runs: int = 0
    abnormal: int = 0
    aborts: int = 0
    hangs: int = 0
    seconds: list[float] = field(default_factory=list)
    failures: list[RunResult] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _worker_cmd(scenario: str, run_dir: Path, steps: int) -> list[str]:
    return [__file__, "--worker", scenario, "--run-dir", str(run_dir), "--steps", str(steps)]


def _launch_torchrun(scenario: str, run_dir: Path, steps: int) -> dict[str, int | None]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1"]
    cmd += [f"--nproc-per-node={WORLD}", "--max-restarts=0"]
    cmd += _worker_cmd(scenario, run_dir, steps)
    with (run_dir / "job.log").open("wb") as log:
        proc = subprocess.Popen(
            cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return {"launcher": _wait(proc)}


def _launch_plain(scenario: str, run_dir: Path, steps: int) -> dict[str, int | None]:
    port = str(_free_port())
    procs = []
    with (run_dir / "job.log").open("wb") as log:
        for rank in range(WORLD):
            env = _env()
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(WORLD))
            env.update(RANK=str(rank), LOCAL_RANK=str(rank))
            cmd = [sys.executable, *_worker_cmd(scenario, run_dir, steps)]
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        return {f"rank-{rank}": _wait(proc) for rank, proc in enumerate(procs)}


def _wait(proc: subprocess.Popen[bytes]) -> int | None:
    """The exit status; None when the job hung (its whole process group is killed: a hung
    rank outlives a killed launcher otherwise)."""
    try:
        return proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None  # a hung job counts as abnormal


def _replay(run_dir: Path) -> int | None:
    bundles = sorted((run_dir / "captures").glob("step-*"))
    with (run_dir / "job.log").open("ab") as log:
        if not bundles:
            log.write(b"stress_exit: no capture was written\n")
            return None
        cmd = [sys.executable, "-m", "trainguard", "replay", str(bundles[0])]
        cmd += ["--factory", "trainguard.demo:make_replay", "--repeats", "1"]
        proc = subprocess.Popen(
            cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return _wait(proc)


def run_once(scenario: str, index: int, launcher: str, steps: int, root: Path) -> RunResult:
    run_dir = root / f"{scenario}-{index:03d}"
    run_dir.mkdir(parents=True)
    start = time.monotonic()
    launch = _launch_torchrun if launcher == "torchrun" else _launch_plain
    statuses = launch(scenario, run_dir, steps)
    if scenario.startswith("capture"):
        statuses["replay"] = _replay(run_dir)
    seconds = time.monotonic() - start
    text = (run_dir / "job.log").read_text(encoding="utf-8", errors="replace")
    aborted = ABORT_TEXT in text
    ok = not aborted and all(code == EXPECTED.get(name, 0) for name, code in statuses.items())
    tail = "" if ok else "\n".join(text.splitlines()[-60:])
    return RunResult(scenario, index, ok, round(seconds, 2), statuses, aborted, tail)


def stress(
    scenarios: list[str], runs: int, launcher: str, steps: int, root: Path
) -> list[ScenarioSummary]:
    """``runs`` rounds; each round runs every scenario once (so load drifts evenly)."""
    summaries = {s: ScenarioSummary(s) for s in scenarios}
    for index in range(runs):
        for scenario in scenarios:
            result = run_once(scenario, index, launcher, steps, root)
            summary = summaries[scenario]
            summary.runs += 1
            summary.seconds.append(result.seconds)
            summary.aborts += int(result.aborted)
            summary.hangs += int(None in result.statuses.values())
            if not result.ok:
                summary.abnormal += 1
                summary.failures.append(result)
                print(f"  {scenario} #{index}: ABNORMAL {result.statuses}", flush=True)
        done = ", ".join(f"{s.scenario} {s.abnormal}/{s.runs}" for s in summaries.values())
        print(f"round {index + 1}/{runs}: abnormal {done}", flush=True)
    return list(summaries.values())


def table(summaries: list[ScenarioSummary]) -> str:
    headers = ["scenario", "runs", "abnormal", "'terminate called'", "hung (killed)", "s/run"]
    rows = [
        [s.scenario, s.runs, s.abnormal, s.aborts, s.hangs, sum(s.seconds) / max(1, len(s.seconds))]
        for s in summaries
    ]
    return markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=50, help="runs of each scenario")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--launcher", choices=("torchrun", "plain"), default="torchrun")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per run")
    parser.add_argument("--keep", type=Path, default=None, help="keep run folders here")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks/stress_exit.json"))
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.run_dir, args.steps)
        return
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; use some of {', '.join(SCENARIOS)}")
    info = machine_info()
    started = now_iso()
    with tempfile.TemporaryDirectory(prefix="tg-stress-") as tmp:
        root = args.keep or Path(tmp)
        summaries = stress(scenarios, args.runs, args.launcher, args.steps, root)
    text = table(summaries)
    print(text)
    report = {
        "benchmark": "stress_exit",
        "started": started,
        "finished": now_iso(),
        "launcher": args.launcher,
        "world": WORLD,
        "steps": args.steps,
        "machine": info,
        "load_average_end": load_average(),
        "scenarios": [asdict(s) for s in summaries],
        "table": text,
    }
    write_json(args.out, report)
    print(f"wrote {args.out}")
    abnormal = sum(s.abnormal for s in summaries)
    raise SystemExit(1 if abnormal else 0)


if __name__ == "__main__":
    main()
