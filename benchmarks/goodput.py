"""Goodput: how much of a run's wall time trains the model when ranks die, hang and blow up?

A 2-rank DDP job on the CPU (gloo; ``goodput_job.py``: a ReLU MLP with dropout, AdamW) trains
``--steps`` steps under torchrun while three faults strike on a schedule, each once: rank 1
is SIGKILLed, rank 1 hangs (sleeps), rank 1's loss is NaN for ``--nan-steps`` steps in a row
(a NaN storm). The contenders, each the same job, run in the same rounds in a shuffled order:

- ``bare``: what users do today: the loop's own ``torch.save`` checkpoint every
  ``--checkpoint-every`` steps, ``torchrun --max-restarts``, resume from that checkpoint; a
  finite check on the gradient norm that raises (torchrun restarts, the job resumes from its
  checkpoint); a watchdog thread of its own (no step for ``--hang-timeout`` s: exit 1) for
  the hang, since gloo's own timeout is 30 minutes;
- ``tg_checkpoint``: trainguard, ``checkpoint_every`` the same, ``resume=True``,
  ``on_escalation="rollback"``, ``hang_timeout``, ``recovery.save_at_failure=False``: a
  restart resumes from the newest good checkpoint on disk; the NaN storm is rolled back to
  the newest good in-memory snapshot (``recovery.snapshot_every``, default 10) without a
  restart;
- ``tg_failure_state``: the same with ``recovery.save_at_failure=True`` (the default): the
  survivors write the state at the start of the step in flight (/dev/shm), the restart
  resumes at that step;
- ``torchft``: torchft (``Manager``, ``ProcessGroupGloo``, its ``DistributedDataParallel``
  and ``Optimizer``), each rank a replica group of one process under its own
  ``torchrun --nproc-per-node=1 --max-restarts``, its ``LighthouseServer`` in the launching
  process (``min_replicas=1``, its other defaults); its ``Manager`` timeout (the
  all-reduce's) ``--hang-timeout``; the NaN storm: the loop's finite check calls
  ``manager.report_error`` (the step is not committed anywhere); the hang: the ``bare``
  watchdog, paused inside torchft's own calls (a survivor waits there for the peer).
  torchft needs its own environment (``--torchft-python``, default
  ``/tmp/tftvenv/bin/python``: ``python3 -m venv /tmp/tftvenv``, ``pip install
  torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu``, ``pip install
  torchft``); without it the mode is reported as not run, with the reason. Measured
  with torch 2.13.0+cpu and torchft 0.2.0 (the JSON's ``torchft``). What it does here: the
  survivor never restarts; it trains on alone (half the batch) once the lighthouse forms a
  quorum without the peer, which needs more than half of the heartbeating replicas: with
  two, a hung replica that still heartbeats (its Rust manager thread does) holds the
  survivor until the watchdog ends it and its heartbeat times out, and a killed one until
  its heartbeat times out or its restart joins.

What each run gives (from rank 0's per-step log, wall-clock times):

- **effective training time**: useful step time / the training span (first step's start to
  the last step's end; ``useful/wall`` also: launch to torchrun's exit, start-up included).
  A step's time is from its batch in hand to the end of its optimizer step, at most the
  run's median step (a step that waited out a failed peer inside its collectives trained
  no longer than the others); useful steps are the last applied execution of each step
  index (the others were undone by a restart or a rollback, or skipped). Checkpoint writes,
  restarts and redone steps are not useful;
- **steps lost per fault**: executions that did not survive (trained again or not applied),
  counted to the fault whose recovery they precede; the step in flight at the fault is not
  counted (it never ended);
- **seconds from the fault to training again**: to the end of the first applied step begun
  after the fault (``s to step``) and of the first such step past the furthest one before
  the fault (``s to new``: redone steps included). torchft's survivor trains on alone, at
  half the batch: ``s to 2 ranks`` is when both replicas train again, and ``reduced steps``
  counts the steps one replica trained alone (their data is the survivor's half only).

Targets (issue 54): steps lost per killed or hung rank <= 1 and fault to training again
(``s to new``) under 10 s for ``tg_failure_state``; effective training time >= 95% at one
fault a minute (the schedule's rate is printed: at ``--quick`` sizes it is far more often).

    python benchmarks/goodput.py                   # 3 rounds of 2400 steps: ~14 min a round
    python benchmarks/goodput.py --rounds 1 --modes bare,tg_failure_state
    python benchmarks/goodput.py --quick           # 120 steps, 1 round: a smoke run (~2.5 min)

The job processes run with ``OMP_NUM_THREADS=1``, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(not for torchft's static rendezvous), ``RES_OPTIONS=timeout:1 attempts:1`` and, where
``PYTHONDONTWRITEBYTECODE`` is set, without it and with ``PYTHONPYCACHEPREFIX`` in the
run's temporary folder: an installed package has its bytecode, and compiling trainguard
again at every restart would cost it about 0.6 s a start on this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    finish,
    finish_args,
    free_port,
    header,
    interleave,
    interval,
    markdown_table,
    median,
    paired,
    parser,
    quick_dns,
    verdict,
)

NAME = "goodput"
MODES = ("bare", "tg_checkpoint", "tg_failure_state", "torchft")
FAULTS = ("kill", "hang", "nan")
MEASURES = ("effective", "effective_wall", "useful_s", "span_s", "wall_s", "median_step_s",
            "steps_lost", "reduced_steps", "faults_per_minute")  # fmt: skip
JOB = Path(__file__).resolve().parent / "goodput_job.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
DEFAULT_TORCHFT = Path("/tmp/tftvenv/bin/python")

# -- one run -------------------------------------------------------------------------------------


def job_args(args: Any) -> list[str]:
    return [
        f"--steps={args.steps}",
        f"--checkpoint-every={args.checkpoint_every}",
        f"--hang-timeout={args.hang_timeout}",
        f"--kill-at={args.kill_at}",
        f"--hang-at={args.hang_at}",
        f"--nan-at={args.nan_at}",
        f"--nan-steps={args.nan_steps}",
        f"--width={args.width}",
        f"--depth={args.depth}",
        f"--batch={args.batch}",
    ]


def job_env(root: Path, torchft: bool) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not torchft:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if env.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    return env


def command(mode: str, run_dir: Path, args: Any) -> list[str]:
    if mode == "torchft":
        python = Path(args.torchft_python)
        ports = f"{free_port()},{free_port()}"
        return [
            str(python), str(JOB), "ft-launch", str(run_dir),
            f"--torchrun={python.parent / 'torchrun'}", f"--max-restarts={args.max_restarts}",
            f"--ports={ports}", *job_args(args),
        ]  # fmt: skip
    return [
        str(TORCHRUN), "--nproc-per-node=2", f"--max-restarts={args.max_restarts}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(JOB), mode, str(run_dir), *job_args(args),
    ]  # fmt: skip


def run_once(mode: str, args: Any, root: Path, index: int) -> dict[str, Any]:
    """Launch one job, wait for it, read its logs back; the run folder is then removed."""
    run_dir = root / f"{mode}-{index}"
    run_dir.mkdir(parents=True)
    log_path = run_dir / "job.log"
    started = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command(mode, run_dir, args),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=job_env(root, mode == "torchft"),
            start_new_session=True,  # a timeout ends the whole job, workers included
        )
        try:
            code: int | None = proc.wait(timeout=args.job_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = None
    ended = time.time()
    result = read_run(run_dir, mode, started, ended, args.steps)
    result["exit_code"] = code
    if code != 0 or not result["complete"]:
        result["log_tail"] = log_path.read_bytes()[-3000:].decode(errors="replace")
        print(f"  {mode}: exit {code}, complete {result['complete']}", file=sys.stderr)
    print(
        f"  {mode}: {ended - started:.0f} s, effective {result.get('effective')}", file=sys.stderr
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


Row = tuple[int, int, float, float, bool, int]
"""A step log's line: attempt, step, t_start, t_end, applied, participants."""


def step_log(path: Path) -> list[Row]:
    rows: list[Row] = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            a, s, t0, t1, applied, parts = line.split(",")
            rows.append((int(a), int(s), float(t0), float(t1), applied == "1", int(parts)))
    return rows


def read_run(run_dir: Path, mode: str, started: float, ended: float, steps: int) -> dict[str, Any]:
    """Rank 0's steps measure the run; rank 1's (the rank the faults strike, restarted in
    every mode) its restarts."""
    rows = step_log(run_dir / "steps-rank0.csv")
    faults = sorted(_jsonl(run_dir / "faults.jsonl"), key=lambda f: float(f["time"]))
    result = analyse(rows, faults, started, ended, steps)
    marks = _jsonl(run_dir / "attempts-rank1.jsonl")
    result["restarts"] = restarts(marks, faults, step_log(run_dir / "steps-rank1.csv"))
    if mode.startswith("tg_"):
        result["guard_events"] = guard_events(run_dir / "tg")
    return result


def guard_events(run_dir: Path) -> dict[str, Any]:
    """Rank 0's resume, rollback and failure-state events (kind, step and what matters)."""
    from trainguard.events import read_events

    keep = {
        "resume": ("from_step", "source"),
        "rollback": ("restored_step", "source", "rung"),
        "failure_state": ("saved", "trigger", "seconds"),
        "hang": ("culprits",),
    }
    out = []
    for event in read_events(run_dir):
        if event["rank"] == 0 and event["kind"] in keep:
            entry = {"kind": event["kind"], "step": event["step"], "time": event["time"]}
            entry |= {k: event.get(k) for k in keep[event["kind"]]}
            out.append(entry)
    return {"events": out}


def analyse(
    rows: Sequence[Row],
    faults: Sequence[dict[str, Any]],
    started: float,
    ended: float,
    steps: int,
) -> dict[str, Any]:
    """The measures of one run (the module docstring)."""
    last: dict[int, int] = {}  # step index -> its last applied execution (row number)
    for i, (_, step, _, _, applied, _) in enumerate(rows):
        if applied:
            last[step] = i
    survivors = set(last.values())
    complete = set(last) >= set(range(steps))
    out: dict[str, Any] = {"complete": complete, "executions": len(rows)}
    if not survivors:
        return out
    # a step counts its own time up to the run's median step: a step that waited out a
    # peer's failure inside its collectives (torchft's survivor) trained no longer than others
    typical = median(rows[i][3] - rows[i][2] for i in survivors)
    useful = sum(min(rows[i][3] - rows[i][2], typical) for i in survivors)
    span = max(r[3] for r in rows) - min(r[2] for r in rows)
    out |= {
        "useful_s": useful,
        "span_s": span,
        "wall_s": ended - started,
        "effective": useful / span,
        "effective_wall": useful / (ended - started),
        "median_step_s": typical,
        "steps_lost": len(rows) - len(survivors),
        "reduced_steps": sum(1 for i in survivors if rows[i][5] < 2),
        "faults_per_minute": 60 * len(faults) / span,
    }
    per_fault = []
    previous = float("-inf")
    reduced = any(r[5] < 2 for r in rows)  # torchft's survivor trained alone at some point
    for fault in faults:
        t = float(fault["time"])
        before = [r[1] for r in rows if r[3] <= t and r[4]]
        furthest = max(before, default=-1)
        after = [r for r in rows if r[2] >= t and r[4]]  # applied steps begun after it
        first = after[0][3] if after else None
        new = next((r[3] for r in after if r[1] > furthest), None)
        full = next((r[3] for r in after if r[5] >= 2), None) if reduced else None
        until = new if new is not None else float("inf")
        lost = [i for i, r in enumerate(rows) if previous < r[3] <= until and i not in survivors]
        per_fault.append(
            {
                "kind": fault["kind"],
                "step": fault["step"],
                "steps_lost": len(lost),
                "s_to_step": None if first is None else first - t,
                "s_to_new": None if new is None else new - t,
                "s_to_2_ranks": None if full is None else full - t,
            }
        )
        previous = until
    out["faults"] = per_fault
    return out


def restarts(
    marks: Sequence[dict[str, Any]], faults: Sequence[dict[str, Any]], rows: Sequence[Row]
) -> list[dict[str, Any]]:
    """Each restart of a rank's process: from the fault before it (``kind``) to the
    process's start, its imports (to ``main``), its set-up (process group, model, guard or
    manager, the resume: to ``ready``), to its first step's end."""
    by_attempt: dict[int, dict[str, float]] = {}
    for m in marks:
        by_attempt.setdefault(int(m["attempt"]), {})[m["what"]] = float(m["time"])
    out = []
    for attempt, times in sorted(by_attempt.items()):
        if attempt == 0 or "process" not in times:
            continue
        earlier = [f for f in faults if float(f["time"]) < times["process"]]
        first = min((r[3] for r in rows if r[0] == attempt), default=None)
        entry: dict[str, Any] = {"attempt": attempt, "kind": None, "fault_to_process_s": None}
        if earlier:
            entry["kind"] = earlier[-1]["kind"]
            entry["fault_to_process_s"] = times["process"] - float(earlier[-1]["time"])
        entry["import_s"] = times["main"] - times["process"] if "main" in times else None
        entry["setup_s"] = (
            times["ready"] - times["main"] if {"ready", "main"} <= set(times) else None
        )
        entry["first_step_s"] = (
            None if first is None or "ready" not in times else first - times["ready"]
        )
        out.append(entry)
    return out


# -- torchft -------------------------------------------------------------------------------------


def probe_torchft(python: Path) -> dict[str, Any]:
    """Whether torchft imports in its environment, and its and torch's versions."""
    if not python.exists():
        return {"available": False, "reason": f"{python} does not exist (see --torchft-python)"}
    code = (
        "import torch, torchft, importlib.metadata as m; "
        "print(torch.__version__, m.version('torchft'))"
    )
    try:
        done = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return {"available": False, "reason": f"{python}: {exc}"}
    if done.returncode != 0:
        return {"available": False, "reason": done.stderr.strip().splitlines()[-1:]}
    torch_version, torchft_version = done.stdout.split()[-2:]
    return {"available": True, "python": str(python), "torch": torch_version,
            "torchft": torchft_version}  # fmt: skip


# -- the report ----------------------------------------------------------------------------------


def _med(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return median(kept) if kept else None


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode, results in runs.items():
        good = [r for r in results if r.get("complete") and r.get("exit_code") == 0]
        entry: dict[str, Any] = {"runs": len(results), "complete_runs": len(good)}
        if good:
            for key in MEASURES:
                entry[key] = median(float(r[key]) for r in good)
            entry["restarts"] = median(len(r["restarts"]) for r in good)
            kinds: dict[str, Any] = {}
            for kind in FAULTS:
                faults = [f for r in good for f in r["faults"] if f["kind"] == kind]
                if faults:
                    kinds[kind] = {
                        "steps_lost": _med([f["steps_lost"] for f in faults]),
                        "steps_lost_max": max(f["steps_lost"] for f in faults),
                        "s_to_step": _med([f["s_to_step"] for f in faults]),
                        "s_to_new": _med([f["s_to_new"] for f in faults]),
                        "s_to_new_max": max((f["s_to_new"] or float("inf")) for f in faults),
                        "s_to_2_ranks": _med([f["s_to_2_ranks"] for f in faults]),
                    }
            entry["faults"] = kinds
            phases: dict[str, Any] = {}
            for kind in FAULTS:
                starts = [s for r in good for s in r["restarts"] if s["kind"] == kind]
                if starts:
                    phases[kind] = {
                        k: _med([s[k] for s in starts])
                        for k in ("fault_to_process_s", "import_s", "setup_s", "first_step_s")
                    }
            entry["restart_phases_s"] = phases
        summary[mode] = entry
    if runs.get("bare"):
        for mode, results in runs.items():
            pairs = [
                (r["effective"], b["effective"])
                for r, b in zip(results, runs["bare"], strict=True)
                if "effective" in r and "effective" in b
            ]
            if mode != "bare" and pairs:
                stats = paired([p[0] for p in pairs], [p[1] for p in pairs])
                summary[mode]["effective_vs_bare"] = stats
    return summary


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    entry = summary.get("tg_failure_state", {})
    for kind in ("kill", "hang"):
        f = entry.get("faults", {}).get(kind)
        lost = None if f is None else float(f["steps_lost_max"])
        secs = None if f is None else float(f["s_to_new_max"])
        out.append({"target": f"steps lost per {kind} <= 1 (tg_failure_state, worst run)",
                    "value": lost, "verdict": verdict(lost, 1, None)})  # fmt: skip
        out.append({"target": f"{kind}: fault to training again < 10 s (tg_failure_state, worst)",
                    "value": secs, "verdict": verdict(secs, 10, None)})  # fmt: skip
    for mode in ("tg_failure_state", "tg_checkpoint"):
        if mode not in summary:
            continue
        eff = summary.get(mode, {}).get("effective")
        rate = summary.get(mode, {}).get("faults_per_minute")
        out.append({
            "target": f"effective training time >= 0.95 ({mode}; {rate or 0:.1f} faults a minute)",
            "value": eff,
            "verdict": verdict(None if eff is None else 1 - eff, 0.05, None),
        })  # fmt: skip
    return out


def print_tables(summary: dict[str, Any], args: Any) -> None:
    print(f"2-rank DDP, CPU gloo: MLP {args.depth} x {args.width}, batch {args.batch}, AdamW; "
          f"{args.steps} steps; kill at {args.kill_at}, hang at {args.hang_at}, "
          f"{args.nan_steps} NaN steps from {args.nan_at}; checkpoint every "
          f"{args.checkpoint_every}; hang_timeout {args.hang_timeout} s")  # fmt: skip
    rows = []
    for mode, e in summary.items():
        vs = e.get("effective_vs_bare", {})
        rows.append([mode, e["complete_runs"], e.get("effective"), vs.get("ratio"),
                     interval(vs.get("ratio_ci95")), e.get("effective_wall"), e.get("useful_s"),
                     e.get("span_s"), e.get("wall_s"), e.get("median_step_s"),
                     e.get("restarts"), e.get("steps_lost"), e.get("reduced_steps")])  # fmt: skip
    headers = ["mode", "runs", "effective", "vs bare", "95% CI", "useful/wall", "useful s",
               "span s", "wall s", "step s", "restarts", "steps lost", "reduced steps"]  # fmt: skip
    print(markdown_table(headers, rows))
    print()
    rows = []
    for mode, e in summary.items():
        for kind, f in e.get("faults", {}).items():
            rows.append([mode, kind, f["steps_lost"], f["steps_lost_max"], f["s_to_step"],
                         f["s_to_new"], f["s_to_2_ranks"]])  # fmt: skip
    print(markdown_table(["mode", "fault", "steps lost", "max", "s to step", "s to new",
                          "s to 2 ranks"], rows))  # fmt: skip
    print()
    rows = []
    for mode, e in summary.items():
        for kind, p in e.get("restart_phases_s", {}).items():
            rows.append([mode, kind, p["fault_to_process_s"], p["import_s"], p["setup_s"],
                         p["first_step_s"]])  # fmt: skip
    if rows:
        print(
            "Restarts of rank 1 (median s): the fault to its new process, the imports, "
            "the set-up (process group, model, guard or manager, resume), the first step"
        )
        print(markdown_table(["mode", "after", "fault -> process", "imports", "set-up",
                              "first step"], rows))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, rounds=3, quick_rounds=1, warmup=0, device=False)
    p.add_argument("--modes", default=",".join(MODES), help=f"default {','.join(MODES)}")
    p.add_argument("--steps", type=int, help="steps a job trains (default 2400; 120 --quick)")
    p.add_argument("--checkpoint-every", type=int, help="K (default 100; 20 --quick)")
    p.add_argument("--kill-at", type=int, help="default: 27%% of the steps, mid-checkpoint")
    p.add_argument("--hang-at", type=int, help="default: 52%% of the steps")
    p.add_argument("--nan-at", type=int, help="default: 77%% of the steps")
    p.add_argument("--nan-steps", type=int, default=5, help="the guard's max_consecutive")
    p.add_argument("--hang-timeout", type=float, default=5.0)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, help="default 256 (128 --quick)")
    p.add_argument("--max-restarts", type=int, default=4)
    p.add_argument("--job-timeout", type=float, help="s a job may run (default 900; 180 --quick)")
    p.add_argument("--torchft-python", type=Path, default=DEFAULT_TORCHFT)
    args = p.parse_args(argv)
    quick_warmup = args.warmup is None
    finish_args(p, args, NAME)
    if args.quick and quick_warmup:
        args.warmup = 0
    args.steps = args.steps or (120 if args.quick else 2400)
    args.checkpoint_every = args.checkpoint_every or (20 if args.quick else 100)
    k = args.checkpoint_every
    # each fault half-way between two checkpoints: the loop's own checkpoint loses K/2 steps,
    # its expected loss
    args.kill_at = args.kill_at or (round(0.27 * args.steps / k) * k + k // 2)
    args.hang_at = args.hang_at or (round(0.52 * args.steps / k) * k + k // 2)
    args.nan_at = args.nan_at or (round(0.77 * args.steps / k) * k + k // 2)
    args.batch = args.batch or (128 if args.quick else 256)
    args.job_timeout = args.job_timeout or (180 if args.quick else 900)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    quick_dns()
    torchft: dict[str, Any] = {"available": False, "reason": "not asked for (--modes)"}
    if "torchft" in modes:
        torchft = probe_torchft(args.torchft_python)
        if not torchft["available"]:
            print(f"torchft not run: {torchft['reason']}", file=sys.stderr)
            modes.remove("torchft")
    settings = {
        "modes": modes, "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps,
        "checkpoint_every": args.checkpoint_every, "kill_at": args.kill_at,
        "hang_at": args.hang_at, "nan_at": args.nan_at, "nan_steps": args.nan_steps,
        "hang_timeout": args.hang_timeout, "width": args.width, "depth": args.depth,
        "batch": args.batch, "max_restarts": args.max_restarts, "world": 2,
    }  # fmt: skip
    report = header(NAME, argv, settings)
    report["torchft"] = torchft
    root = Path(tempfile.mkdtemp(prefix="tg-goodput-"))
    try:
        env = job_env(root, False)  # trainguard's bytecode once, as an installed package has it
        subprocess.run([sys.executable, "-c", "import trainguard as tg; tg.Guard"], env=env,
                       check=True, timeout=120)  # fmt: skip
        count = iter(range(10**6))
        runs = interleave(modes, lambda m: run_once(m, args, root, next(count)), args.rounds,
                          args.warmup, seed=args.seed)  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarise(runs)
    print_tables(summary, args)
    checks = targets(summary)
    print()
    print(markdown_table(["target", "value", "verdict"],
                         [[t["target"], t["value"], t["verdict"]] for t in checks]))  # fmt: skip
    report.update(runs=runs, summary=summary, targets=checks)
    finish(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
