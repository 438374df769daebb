"""What timing every rank costs: ``detect_stragglers`` on vs off (issue 24).

With ``detect_stragglers=True`` (the default) the guard times each rank's data wait (around
each fetch in ``watch()``) and its own forward (a pre-hook and a hook on the inner module),
sends both in the step's existing all-reduce, and runs the straggler rule on the agreed
numbers (``StragglerWatch.observe``). Compared under 2-rank DDP (gloo, spawned processes,
one thread each) on the transformer workload of ``overhead_modes.py``, in the same rounds,
in random order each round (the same order on both ranks):

- ``timing_on``: ``tg.Guard`` with its defaults;
- ``timing_off``: the same guard with ``detect_stragglers=False`` (no timer, no rule).

A whole step's ratio on a shared machine is blurred by noise larger than the cost, so the
direct costs are measured too: ``observe()`` inside the runs (rank 0), the two hooks per
forward and the clock pair per fetch (microbenchmarks), and ``observe()`` alone at larger
worlds (synthetic times, window full).

    python benchmarks/straggler_cost.py                  # 5 rounds
    python benchmarks/straggler_cost.py --quick          # tiny sizes (smoke test)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import start_processes
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_info, markdown_table, median, now_iso, quartiles, write_json
from overhead_modes import Workload, workloads

import trainguard as tg
from trainguard.events import EventLog
from trainguard.health.stragglers import StragglerWatch
from trainguard.health.timing import StepTimer

MODES = ("timing_on", "timing_off")
WORLD = 2


def run_mode(
    workload: Workload, initial: nn.Module, mode: str, steps: int, run_dir: Path
) -> tuple[float, float]:
    """Median ms per step of ``steps`` timed steps (after 3), and ``observe()`` ms per step."""
    model = DDP(copy.deepcopy(initial))
    opt = torch.optim.AdamW(model.parameters(), lr=workload.lr)
    gen = torch.Generator().manual_seed(dist.get_rank())
    data = [workload.batch(gen) for _ in range(steps + 3)]
    on = mode == "timing_on"
    config = tg.GuardConfig(run_dir=run_dir, hang_timeout=0, detect_stragglers=on)
    guard = tg.Guard(model, opt, config=config)
    observed = [0.0]
    inner = guard.stragglers.observe

    def timed(*args: Any) -> None:
        start = time.perf_counter()
        inner(*args)
        observed[0] += time.perf_counter() - start

    guard.stragglers.observe = timed  # type: ignore[method-assign,assignment]
    times: list[float] = []
    start = time.perf_counter()
    for i, batch in enumerate(guard.watch(data)):
        loss = workload.loss(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        if guard.check(loss):
            opt.step()
        opt.zero_grad()
        end = time.perf_counter()
        if i >= 3:
            times.append((end - start) * 1e3)
        start = end
    guard.close()
    return median(times), observed[0] * 1e3 / (steps + 3)


def _worker(rank: int, port: int, args: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    try:
        workload = workloads("quick" if args["quick"] else "cpu")["transformer"]
        torch.manual_seed(0)
        initial = workload.build()
        rng = random.Random(0)  # the same order on both ranks
        per_mode: dict[str, list[float]] = {mode: [] for mode in MODES}
        observe_ms: list[float] = []
        with tempfile.TemporaryDirectory() as root:
            for mode in MODES:  # a discarded round: first-use costs
                run_mode(workload, initial, mode, 2, Path(root) / f"warm-{mode}")
            for round_ in range(args["rounds"]):
                order = list(MODES)
                rng.shuffle(order)
                for mode in order:
                    run_dir = Path(root) / f"{round_}-{mode}"
                    ms, obs = run_mode(workload, initial, mode, args["steps"], run_dir)
                    per_mode[mode].append(ms)
                    if mode == "timing_on":
                        observe_ms.append(obs)
        if rank == 0:
            result = {"ms_per_step": per_mode, "observe_ms_per_step": observe_ms}
            Path(out).write_text(json.dumps(result), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def hook_costs(repeats: int) -> dict[str, float]:
    """Microseconds: what the timer's two hooks add to one forward call, and one clock pair
    around a fetch."""
    module = nn.Identity()
    x = torch.zeros(1)

    def per_call() -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            module(x)
        return (time.perf_counter() - start) / repeats * 1e6

    bare = min(per_call() for _ in range(3))
    timer = StepTimer(module)
    hooked = min(per_call() for _ in range(3))
    start = time.perf_counter()
    for _ in range(repeats):
        timer.data_started()
        timer.data_ended()
    pair = (time.perf_counter() - start) / repeats * 1e6
    timer.close()
    return {"forward_hooks_us": hooked - bare, "fetch_clock_us": pair}


def observe_costs(worlds: tuple[int, ...], steps: int) -> dict[str, float]:
    """Microseconds per ``observe()`` at each world size (window full, noisy healthy times)."""
    out: dict[str, float] = {}
    rng = random.Random(0)
    for world in worlds:
        rows = [[0.01 + rng.random() * 1e-3 for _ in range(world)] for _ in range(64)]
        with tempfile.TemporaryDirectory() as run_dir:
            config = tg.GuardConfig(run_dir=run_dir)
            watch = StragglerWatch(config, EventLog(Path(run_dir), 0), 0)
            for i in range(64):  # warm-up and a full window
                watch.observe(i, rows[i], rows[-i])
            start = time.perf_counter()
            for i in range(steps):
                watch.observe(i, rows[i % 64], rows[-(i % 64)])
            out[str(world)] = (time.perf_counter() - start) / steps * 1e6
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=0, help="timed steps per mode and round")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/cpu/straggler_cost.json")
    )
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.quick else 15)
    results: dict[str, Any] = {"machine": machine_info(), "time": now_iso(), "note": args.note}
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "ddp.json")
        spec = {"quick": args.quick, "rounds": args.rounds, "steps": steps}
        args_ = (_free_port(), spec, out)
        start_processes(_worker, args=args_, nprocs=WORLD, start_method="spawn")  # type: ignore[no-untyped-call]
        ddp: dict[str, Any] = json.loads(Path(out).read_text(encoding="utf-8"))
    per_mode = ddp["ms_per_step"]
    ratios = [a / b for a, b in zip(per_mode["timing_on"], per_mode["timing_off"], strict=True)]
    off_ms = median(per_mode["timing_off"])
    hooks = hook_costs(2000 if args.quick else 50000)
    direct_ms = median(ddp["observe_ms_per_step"]) + hooks["forward_hooks_us"] / 1e3
    direct_ms += hooks["fetch_clock_us"] / 1e3
    results.update(
        workload=workloads("quick" if args.quick else "cpu")["transformer"].sizes,
        world=WORLD,
        rounds=args.rounds,
        steps=steps,
        ms_per_step=per_mode,
        ratios_on_over_off=ratios,
        observe_ms_per_step=ddp["observe_ms_per_step"],
        hooks=hooks,
        direct_ms_per_step=direct_ms,
        direct_share_of_step=direct_ms / off_ms,
        observe_us_by_world=observe_costs((2, 8, 64, 1024), 200 if args.quick else 2000),
    )
    low, high = quartiles(ratios)
    rows: list[list[object]] = [["timing_on / timing_off (whole step)", median(ratios), low, high]]
    print(markdown_table(["2-rank DDP transformer", "median", "q25", "q75"], rows))
    share = results["direct_share_of_step"] * 100
    print(f"timing_off: {off_ms:.1f} ms/step; direct cost {direct_ms * 1e3:.1f} us/step ", end="")
    print(f"(observe {median(ddp['observe_ms_per_step']) * 1e3:.1f} us) = {share:.4f}% of a step")
    worlds = ", ".join(f"{w} ranks {us:.0f} us" for w, us in results["observe_us_by_world"].items())
    print(f"observe() alone: {worlds}")
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
