"""What ``trainguard run`` costs an unmodified script (issue 27).

The script is ``_run_workload.py``: the transformer workload of ``overhead_modes`` (cpu
sizes, AdamW, one thread a process) as a plain training loop that knows nothing of
trainguard. Each round runs it twice, bare and under ``trainguard run``, in a random order
(interleaved rounds: a shared machine's drift hits both modes alike); ``--world 2`` runs it
under torchrun (DDP, gloo) instead of one process.

Two measures, per round "guarded / bare", then the median over the rounds with a bootstrap
95% interval:

- **step**: the median step time of rank 0 (forward, backward, optimizer step, zero_grad;
  after the warm-up steps). This is the guard's per-step cost: the optimizer hooks, the
  gradient check and its all-reduce, the model hook recording the micro-batch;
- **process**: rank 0's whole process, from the script's first line to its end (start-up
  included: trainguard is imported into the process at torch's import).

    python benchmarks/run_overhead.py                       # 6 rounds, 1 process
    python benchmarks/run_overhead.py --world 2 --rounds 4  # torchrun, 2 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bootstrap_ci, load_average, machine_info, median, now_iso, write_json

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_run_workload.py"
RESULTS = HERE / "results" / "cpu"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def command(mode: str, world: int, steps: int, warmup: int, out: Path, run_dir: Path) -> list[str]:
    if world == 1:
        script = [sys.executable, str(SCRIPT)]
    else:
        torchrun = str(Path(sys.executable).parent / "torchrun")
        port = _free_port()
        script = [torchrun, f"--nproc-per-node={world}", "--rdzv-backend=c10d"]
        script += [f"--rdzv-endpoint=localhost:{port}", str(SCRIPT)]
    script += ["--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    if mode == "bare":
        return script
    guard = [sys.executable, "-m", "trainguard.cli", "run", "--run-dir", str(run_dir), "--"]
    return guard + script


def one_run(mode: str, world: int, steps: int, warmup: int, root: Path, index: int) -> Any:
    out = root / f"{mode}-{index}.json"
    cmd = command(mode, world, steps, warmup, out, root / f"run-{index}")
    env = {k: v for k, v in os.environ.items() if k != "TRAINGUARD_RUN"}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(out.read_text())


def _median_of(values: list[float]) -> Callable[[list[int]], float]:
    def statistic(indices: list[int]) -> float:
        return median([values[i] for i in indices])

    return statistic


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=1, choices=(1, 2))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    load_before = load_average()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tg-run-overhead-") as tmp:
        for index in range(args.rounds):
            order = ["bare", "guarded"]
            rng.shuffle(order)
            found = {
                m: one_run(m, args.world, args.steps, args.warmup, Path(tmp), index) for m in order
            }
            row = {
                "order": order,
                "load_average": load_average(),
                **{f"{m}_step_ms": round(1000 * median(found[m]["step_s"]), 2) for m in order},
                **{f"{m}_process_s": round(found[m]["process_s"], 2) for m in order},
            }
            row["step_ratio"] = row["guarded_step_ms"] / row["bare_step_ms"]
            row["process_ratio"] = row["guarded_process_s"] / row["bare_process_s"]
            rounds.append(row)
            print(json.dumps(row), flush=True)
    summary: dict[str, Any] = {}
    for key in ("step_ratio", "process_ratio"):
        values = [r[key] for r in rounds]
        low, high = bootstrap_ci(len(values), _median_of(values))
        summary[key] = {"median": round(median(values), 4), "ci95": [round(low, 4), round(high, 4)]}
    result = {
        "benchmark": "run_overhead",
        "time": now_iso(),
        "workload": "transformer (overhead_modes cpu sizes: vocab 4096, dim 256, 4 layers, "
        "4 heads, seq 128, batch 8), AdamW, 1 thread a process",
        "world": args.world,
        "launch": "python script.py" if args.world == 1 else "torchrun (c10d, gloo DDP)",
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "machine": machine_info(),
        "summary": summary,
        "per_round": rounds,
    }
    out = args.out or RESULTS / f"run_overhead_world{args.world}.json"
    write_json(out, result)
    print(json.dumps(summary))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
