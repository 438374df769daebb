"""False alarms and detection of the straggler rule on real runs (issue 24).

Healthy runs: ``--runs`` jobs of 4-rank DDP (gloo, spawned processes, one thread each) on
this machine, ``--steps`` steps of an MLP whose forward takes about 10-20 ms on a shared
core, where both floors of the rule meet (1.5 x 20 ms is 10 ms lost). Four ranks on a
two-core machine are a noisy cluster: the scheduler starves a random rank at random steps.
Each run counts its ``straggler`` events, and its metrics log is replayed through the rule
offline to find the closest approach: over every window, the largest
``min(slowdown / straggler_slowdown, lost / straggler_min_lost)`` of any rank (an alarm
needs 1), for the rule (each rank's lower quartile) and for the first design (each rank's
median), at windows of 20 and 40.

Slow runs: one rank's forward 40 ms slower, then one rank's loader 40 ms slower: the step
of the first event and the ranks it names.

    python benchmarks/straggler_eval.py --runs 10        # a few minutes on 2 cores
    python benchmarks/straggler_eval.py --quick          # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.multiprocessing.spawn import start_processes
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_info, markdown_table, now_iso, write_json

import trainguard as tg
from trainguard.events import read_events
from trainguard.health.stragglers import PhaseWindow, judge

WORLD = 4
DELAY = 0.04


class Net(nn.Module):
    def __init__(self, width: int, delay: float) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width)
        )
        self.delay = delay

    def forward(self, x: Tensor) -> Tensor:
        if self.delay:
            time.sleep(self.delay)
        out: Tensor = self.body(x)
        return out


def _batches(rank: int, steps: int, width: int, batch: int, delay: float) -> Iterator[Tensor]:
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        if delay:
            time.sleep(delay)
        yield torch.randn(batch, width, generator=gen)


def _job(rank: int, port: int, spec: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    try:
        slow = rank == spec["slow_rank"]
        torch.manual_seed(0)
        model = DDP(Net(spec["width"], DELAY if slow and spec["phase"] == "compute" else 0.0))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        delay = DELAY if slow and spec["phase"] == "data" else 0.0
        data = _batches(rank, spec["steps"], spec["width"], spec["batch"], delay)
        with tg.Guard(model, opt, run_dir=spec["run_dir"], hang_timeout=0) as guard:
            for x in guard.watch(data):
                loss = model(x).pow(2).mean()
                loss.backward()  # type: ignore[no-untyped-call]
                guard.step(loss)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_job(
    run_dir: Path, steps: int, width: int, batch: int, slow_rank: int | None, phase: str | None
) -> None:
    spec = {"run_dir": str(run_dir), "steps": steps, "width": width, "batch": batch}
    spec |= {"slow_rank": slow_rank, "phase": phase}
    args = (_free_port(), spec)
    start_processes(_job, args=args, nprocs=WORLD, start_method="spawn")  # type: ignore[no-untyped-call]


def closest_approach(series: list[list[float]], window: int, quartile: bool) -> dict[str, float]:
    """Replays a phase's per-step times: the largest alarm score over every window, with the
    slowdown and lost seconds of that window's worst rank."""
    config = tg.GuardConfig()
    ring = PhaseWindow(window)
    best = {"score": 0.0, "slowdown": 0.0, "lost": 0.0}
    for times in series[config.straggler_warmup :]:
        ring.add(times)
        if not ring.full:
            continue
        medians, lows = ring.stats()
        verdict = judge(
            medians,
            config.straggler_slowdown,
            config.straggler_min_lost,
            lows=lows if quartile else medians,
        )
        for rank in range(len(times)):
            score = min(
                verdict.slowdown(rank) / config.straggler_slowdown,
                verdict.lost(rank) / config.straggler_min_lost,
            )
            if score > best["score"]:
                best = {
                    "score": score,
                    "slowdown": verdict.slowdown(rank),
                    "lost": verdict.lost(rank),
                }
    return best


def healthy_run(run_dir: Path, steps: int, width: int, batch: int) -> dict[str, Any]:
    run_job(run_dir, steps, width, batch, None, None)
    events = [e for e in read_events(run_dir, rank=0) if e["kind"] == "straggler"]
    lines = (run_dir / "metrics" / "rank-0.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    compute = [r["compute_times"] for r in records if "compute_times" in r]
    medians = sorted(sorted(col)[len(col) // 2] for col in zip(*compute, strict=True))
    return {
        "events": len(events),
        "named": [e["ranks"] for e in events],
        "compute_ms_median_rank": medians[(len(medians) - 1) // 2] * 1e3,
        "closest": {
            f"{'quartile' if q else 'median'}_{w}": closest_approach(compute, w, q)
            for q in (True, False)
            for w in (20, 40)
        },
    }


def slow_run(run_dir: Path, phase: str, slow_rank: int, steps: int) -> dict[str, Any]:
    run_job(run_dir, steps, 8, 6, slow_rank, phase)
    events = [e for e in read_events(run_dir, rank=0) if e["kind"] == "straggler"]
    first = events[0] if events else {}
    return {
        "phase": phase,
        "slow_rank": slow_rank,
        "first_step": first.get("step"),
        "first_ranks": first.get("ranks"),
        "first_phase": first.get("phase"),
        "ranks_ever_named": sorted({r for e in events for r in e["ranks"]}),
        "lost_per_step": first.get("lost_per_step"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/cpu/straggler_eval.json")
    )
    args = parser.parse_args(argv)
    width, batch = (32, 8) if args.quick else (512, 128)
    runs = 1 if args.quick else args.runs
    steps = 60 if args.quick else args.steps
    results: dict[str, Any] = {"machine": machine_info(), "time": now_iso(), "note": args.note}
    with tempfile.TemporaryDirectory() as tmp:
        healthy = []
        for i in range(runs):
            healthy.append(healthy_run(Path(tmp) / f"healthy-{i}", steps, width, batch))
            results["load_after_run"] = machine_info()["load_average"]
        slow = [
            slow_run(Path(tmp) / f"slow-{p}", p, r, 80) for p, r in (("compute", 1), ("data", 2))
        ]
    results.update(world=WORLD, steps=steps, width=width, batch=batch, healthy=healthy, slow=slow)
    keys = list(healthy[0]["closest"])
    rows: list[list[object]] = [
        [
            i,
            h["events"],
            round(h["compute_ms_median_rank"], 1),
            *(round(h["closest"][k]["score"], 2) for k in keys),
        ]
        for i, h in enumerate(healthy)
    ]
    print(markdown_table(["run", "events", "median fwd ms", *keys], rows))
    for s in slow:
        first = f"step {s['first_step']} naming {s['first_ranks']} ({s['first_phase']})"
        print(f"{s['phase']} straggler rank {s['slow_rank']}: first event at {first}; ", end="")
        print(f"ranks ever named {s['ranks_ever_named']}")
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
