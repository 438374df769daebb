"""What torch's flight recorder costs a training step (issue 24).

A hang report compares the ranks' collectives from the recorder, so trainguard wants it on
(torch 2.13's default: 2000 entries; trainguard's launchers set ``TORCH_FR_BUFFER_SIZE=2000``
where nothing set it). torch reads the size once, when the process
group is created, so "on" and "off" cannot share a process: each job is a fresh 2-rank DDP
run (spawned processes, gloo) of the transformer workload of ``overhead_modes``, with the
recorder off (``TORCH_FR_BUFFER_SIZE=0``) or on (2000). Rounds are interleaved: each round
runs one job of each setting, in a random order.

Per job, both modes of ``overhead_modes`` that matter here, one step each in turn:

- ``bare``: DDP training without trainguard;
- ``guard``: the same under ``tg.Guard`` (its check's all-reduce is recorded too).

Two measures of the cost:

- **step time**: per round, the median step of the "on" job over the "off" job's, per mode;
  the median of those ratios over the rounds, with a bootstrap 95% interval. Separate jobs
  on a shared machine differ by several percent for reasons of their own, so this bounds
  the cost rather than resolving it;
- **direct**: what recording adds to one collective, measured where nothing else blurs it:
  a 1-element all-reduce in a 1-rank gloo group (no network; its own process per setting,
  in the round's order), timed in blocks, "on" minus "off" per round; times the
  collectives of a step of each mode (counted by the recorder in the "on" jobs), as a share
  of that mode's step. The 2-rank jobs also time the same all-reduce between the ranks
  (``pair_us``: the loopback round trip, whose noise hides the difference).
  Each timing is the fastest of its blocks (the least disturbed by other processes).

    python benchmarks/flight_recorder_cost.py                  # 6 rounds, cpu sizes
    python benchmarks/flight_recorder_cost.py --direct-only --rounds 20   # the direct cost
    python benchmarks/flight_recorder_cost.py --quick          # tiny sizes: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    bootstrap_ci,
    load_average,
    machine_info,
    markdown_table,
    median,
    now_iso,
    quartiles,
    write_json,
)
from overhead_measure import Settings, build_context, round_order
from overhead_modes import make_runner, workloads

from trainguard.step.held_work import HeldWork

SETTINGS = {"off": "0", "on": "2000"}
MODES = ("bare", "guard")
WORLD = 2


@dataclass(frozen=True)
class Plan:
    rounds: int
    steps: int
    warmup: int
    collectives: int
    """1-element all-reduces timed between the 2 ranks of a job."""
    solo_collectives: int
    """1-element all-reduces timed in the 1-rank group (the direct cost)..."""
    solo_blocks: int
    """... in this many blocks: short ones, so that some run while nothing else does."""
    blocks: int
    """The all-reduces are timed in this many blocks; the median block counts."""
    sizes: str
    seed: int
    direct_only: bool = False
    """Only the 1-rank measure (no 2-rank jobs): more rounds of it in little time."""


# -- one job (runs in each spawned rank) --------------------------------------------------------


def job_worker(rank: int, port: int, fr_size: str, plan: Plan, run_root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["TORCH_FR_BUFFER_SIZE"] = fr_size  # before the process group: torch reads it then
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    try:
        result = measure_job(rank, plan, Path(run_root))
        if rank == 0:
            write_json(Path(out), result)
    finally:
        dist.destroy_process_group()


def measure_job(rank: int, plan: Plan, run_root: Path) -> dict[str, Any]:
    workload = workloads(plan.sizes)["transformer"]
    settings = Settings(
        workloads=("transformer",),
        worlds=(WORLD,),
        modes=MODES,
        rounds=plan.steps,
        warmup=plan.warmup,
        slow_every=1,
        sizes=plan.sizes,
        seed=plan.seed,
        threads=1,
        max_norm=None,
    )
    runners = {
        mode: make_runner(mode, build_context(workload, mode, settings, rank, WORLD, run_root))
        for mode in MODES
    }
    for r in range(plan.warmup):
        for mode in round_order(list(MODES), plan.seed, -1 - r):
            runners[mode].step()
    steps: dict[str, list[float]] = {mode: [] for mode in MODES}
    counts: dict[str, int | None] = dict.fromkeys(MODES, 0)
    for r in range(plan.steps):
        for mode in round_order(list(MODES), plan.seed, r):
            before = enqueued()  # outside the step's own clock
            steps[mode].append(runners[mode].step()["total"])
            after, count = enqueued(), counts[mode]
            done = None if before is None or after is None else after - before
            counts[mode] = None if done is None or count is None else count + done
    for runner in runners.values():
        runner.close()
    return {
        "step_ms": steps,
        "median_ms": {mode: median(values) for mode, values in steps.items()},
        "collectives_per_step": {
            mode: None if n is None else n / plan.steps for mode, n in counts.items()
        },
        "recorded_entries": recorded_entries(),
        "pair_us": time_collectives(plan.collectives, plan.blocks),
    }


def enqueued() -> int | None:
    """Collectives enqueued on the default group so far (the recorder's count; None: off)."""
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    status = pickle.loads(dump(includeCollectives=False)).get("pg_status", {}).get("0")
    return int(status["last_enqueued_collective"]) if status else None


def recorded_entries() -> int:
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return 0
    return len(pickle.loads(dump(includeStackTraces=False)).get("entries", []))


def time_collectives(count: int, blocks: int) -> dict[str, float]:
    """Microseconds per 1-element all-reduce over ``blocks`` timed blocks: the median block
    and the fastest (the least disturbed by other processes on a shared machine)."""
    tensor = torch.zeros(1)
    held = HeldWork()  # the works stay with the main thread (step/held_work.py: issue 15)
    per_block = max(1, count // blocks)
    for _ in range(per_block):
        held.wait(dist.all_reduce(tensor, async_op=True))
    times = []
    for _ in range(blocks):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(per_block):
            held.wait(dist.all_reduce(tensor, async_op=True))
        times.append((time.perf_counter() - start) / per_block * 1e6)
    held.retire()  # the last work is released at exit, not by gloo's thread
    return {"median_us": median(times), "min_us": min(times)}


def solo_worker(rank: int, port: int, fr_size: str, plan: Plan, out: str) -> None:
    """A 1-rank gloo group: what recording adds to a collective, without the network."""
    os.environ["TORCH_FR_BUFFER_SIZE"] = fr_size
    torch.set_num_threads(1)
    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=1)
    try:
        write_json(Path(out), time_collectives(plan.solo_collectives, plan.solo_blocks))
    finally:
        dist.destroy_process_group()


def run_solo(fr_size: str, plan: Plan, root: Path, name: str) -> dict[str, float]:
    out = root / f"{name}-solo.json"
    start_processes(  # type: ignore[no-untyped-call]
        solo_worker,
        args=(_free_port(), fr_size, plan, str(out)),
        nprocs=1,
        join=True,
        start_method="spawn",
    )
    result: dict[str, float] = json.loads(out.read_text(encoding="utf-8"))
    return result


def run_job(fr_size: str, plan: Plan, root: Path, name: str) -> dict[str, Any]:
    out = root / f"{name}.json"
    args = (_free_port(), fr_size, plan, str(root / name), str(out))
    start_processes(  # type: ignore[no-untyped-call]
        job_worker, args=args, nprocs=WORLD, join=True, start_method="spawn"
    )
    result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return result


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- rounds and the summary ---------------------------------------------------------------------


def run_rounds(plan: Plan) -> list[dict[str, Any]]:
    rounds = []
    with tempfile.TemporaryDirectory(prefix="tg-fr-") as tmp:
        for r in range(plan.rounds):
            order = list(SETTINGS)
            random.Random(f"{plan.seed}:{r}").shuffle(order)
            jobs: dict[str, dict[str, Any]] = {}
            for setting in order:
                name = f"r{r}-{setting}"
                job = {} if plan.direct_only else run_job(SETTINGS[setting], plan, Path(tmp), name)
                jobs[setting] = {**job, "solo": run_solo(SETTINGS[setting], plan, Path(tmp), name)}
                print(f"round {r + 1}/{plan.rounds} {setting}: {short(job)}", file=sys.stderr)
            rounds.append({"order": order, **jobs})
    return rounds


def median_of(values: list[float]) -> Callable[[list[int]], float]:
    """The bootstrap's statistic: the median of ``values`` at the resampled indices."""

    def statistic(indices: list[int]) -> float:
        return median([values[i] for i in indices])

    return statistic


def short(job: dict[str, Any]) -> str:
    return f"bare {job['median_ms']['bare']:.1f} ms" if job else "direct only"


def summarize(rounds: list[dict[str, Any]], plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {"modes": {} if plan.direct_only else step_ratios(rounds)}
    out["direct"] = direct_cost(rounds, plan)
    return out


def step_ratios(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: the "on" job's median step over the "off" job's, round by round."""
    out: dict[str, Any] = {}
    for mode in MODES:
        ratios = [r["on"]["median_ms"][mode] / r["off"]["median_ms"][mode] for r in rounds]
        p25, p75 = quartiles(ratios)
        low, high = bootstrap_ci(len(rounds), median_of(ratios))
        out[mode] = {
            "off_ms": median([r["off"]["median_ms"][mode] for r in rounds]),
            "on_ms": median([r["on"]["median_ms"][mode] for r in rounds]),
            "ratio": median(ratios),
            "ratio_p25": p25,
            "ratio_p75": p75,
            "ratio_ci95": [low, high],
            "ratios": [round(x, 4) for x in ratios],
        }
    return out


def direct_cost(rounds: list[dict[str, Any]], plan: Plan) -> dict[str, Any]:
    """What recording adds to a collective in the 1-rank group (fastest blocks, on minus off
    per round), and its share of each mode's step."""
    added = [r["on"]["solo"]["min_us"] - r["off"]["solo"]["min_us"] for r in rounds]
    added_median = [r["on"]["solo"]["median_us"] - r["off"]["solo"]["median_us"] for r in rounds]
    low, high = bootstrap_ci(len(rounds), median_of(added))
    out: dict[str, Any] = {
        "solo_off_us": median([r["off"]["solo"]["min_us"] for r in rounds]),
        "solo_on_us": median([r["on"]["solo"]["min_us"] for r in rounds]),
        "added_us": median(added),
        "added_us_ci95": [low, high],
        "added_us_rounds": [round(x, 3) for x in added],
        "added_us_by_median_blocks": median(added_median),
    }
    if not plan.direct_only:
        out["pair_off_us"] = median([r["off"]["pair_us"]["median_us"] for r in rounds])
        out["pair_on_us"] = median([r["on"]["pair_us"]["median_us"] for r in rounds])
        out["modes"] = {mode: direct_share(rounds, mode, median(added), high) for mode in MODES}
    return out


def direct_share(
    rounds: list[dict[str, Any]], mode: str, added_us: float, added_high_us: float
) -> dict[str, Any]:
    """The added time per collective times the mode's collectives per step, as a share of
    its step (off); ``high`` from the interval's upper end."""
    counts = [r["on"]["collectives_per_step"][mode] for r in rounds]
    per_step = median([c for c in counts if c is not None]) if any(counts) else None
    step_ms = median([r["off"]["median_ms"][mode] for r in rounds])
    if per_step is None:
        return {"collectives_per_step": None, "step_ms": step_ms, "percent": None}
    return {
        "collectives_per_step": per_step,
        "step_ms": step_ms,
        "percent": 100 * max(added_us, 0.0) * per_step / 1e3 / step_ms,
        "percent_high": 100 * max(added_high_us, 0.0) * per_step / 1e3 / step_ms,
    }


def render(summary: dict[str, Any], plan: Plan) -> str:
    d = summary["direct"]
    solo = (
        f"1-element all-reduce in a 1-rank gloo group (fastest of {plan.solo_blocks} blocks): off "
        f"{d['solo_off_us']:.2f} us, on {d['solo_on_us']:.2f} us; recording adds "
        f"{d['added_us']:.2f} us (95% CI {d['added_us_ci95'][0]:.2f} to "
        f"{d['added_us_ci95'][1]:.2f}; {d['added_us_by_median_blocks']:.2f} by median blocks)."
    )
    note = f"{plan.rounds} rounds, each setting once per round in random order."
    if plan.direct_only:
        return f"{solo}\n{note}\n"
    step_rows = [
        [
            mode,
            s["off_ms"],
            s["on_ms"],
            s["ratio"],
            f"{s['ratio_ci95'][0]:.3f}-{s['ratio_ci95'][1]:.3f}",
            100 * (s["ratio"] - 1),
        ]
        for mode, s in summary["modes"].items()
    ]
    steps = markdown_table(["mode", "off ms", "on ms", "on/off", "95% CI", "cost %"], step_rows)
    shares = markdown_table(
        ["mode", "collectives / step", "step ms", "added us / collective", "% of step", "high %"],
        [share_row(mode, m, d["added_us"]) for mode, m in d["modes"].items()],
    )
    pair = (
        f"Between the 2 ranks (median block): off {d['pair_off_us']:.1f} us, on "
        f"{d['pair_on_us']:.1f} us."
    )
    note += (
        f" 2-rank DDP jobs (gloo, transformer, {plan.sizes} sizes): {plan.steps} steps per "
        f"mode per job after {plan.warmup} warm-up."
    )
    return f"{steps}\n\n{shares}\n\n{solo}\n{pair}\n{note}\n"


def share_row(mode: str, share: dict[str, Any], added_us: float) -> list[object]:
    count, step_ms = share["collectives_per_step"], share["step_ms"]
    return [mode, count, step_ms, added_us, share["percent"], share.get("percent_high")]


def parse_args(argv: list[str] | None) -> tuple[Plan, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="rounds (default 6; 2 with --quick)")
    parser.add_argument("--steps", type=int, help="timed steps per mode per job (default 15)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--collectives", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument(
        "--direct-only", action="store_true", help="only the 1-rank per-collective measure"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path("runs/benchmarks/flight_recorder_cost.json")
    )
    args = parser.parse_args(argv)
    plan = Plan(
        rounds=args.rounds or (2 if args.quick else 6),
        steps=args.steps or (3 if args.quick else 15),
        warmup=1 if args.quick else args.warmup,
        collectives=200 if args.quick else args.collectives,
        solo_collectives=2000 if args.quick else 50000,
        solo_blocks=10 if args.quick else 100,
        blocks=5 if args.quick else 20,
        sizes="quick" if args.quick else "cpu",
        seed=args.seed,
        direct_only=args.direct_only,
    )
    return plan, args


def main(argv: list[str] | None = None) -> None:
    plan, args = parse_args(argv)
    started, load_start = now_iso(), load_average()
    rounds = run_rounds(plan)
    summary = summarize(rounds, plan)
    report = {
        "benchmark": "flight_recorder_cost",
        "date": started,
        "command": " ".join(["python", "benchmarks/flight_recorder_cost.py", *sys.argv[1:]]),
        "plan": asdict(plan),
        "settings": SETTINGS,
        "machine": machine_info(),
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "summary": summary,
        "rounds": rounds,
    }
    write_json(args.out, report)
    print(render(summary, plan))


if __name__ == "__main__":
    main()
