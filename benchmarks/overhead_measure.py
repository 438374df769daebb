"""How the overhead benchmark measures: every mode built up front, then rounds of one step
per mode in a freshly shuffled order (the same on every rank), summarized against each
mode's reference, in one process or in 2-rank DDP (spawned processes).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import random
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import cpus_available, median, quartiles, write_json
from overhead_modes import (
    MODES,
    PHASES,
    Batch,
    ModeContext,
    Runner,
    Sample,
    Workload,
    make_runner,
)
from torch.multiprocessing.spawn import start_processes
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class Settings:
    workloads: tuple[str, ...]
    worlds: tuple[int, ...]
    modes: tuple[str, ...]
    rounds: int
    warmup: int
    slow_every: int
    sizes: str
    """Key of SIZES: ``quick`` (smoke test), ``cpu`` (the default), ``gpu``."""
    seed: int
    threads: int | None
    max_norm: float | None
    device: str = "cpu"
    """``cpu`` or ``cuda`` (each rank then uses ``cuda:<rank>``, DDP over NCCL)."""
    batches_per_mode: int = 4


def threads_for(settings: Settings, world: int) -> int:
    """Threads per process: the CPUs split among the ranks (2 alone, 1 each for 2 ranks here)."""
    if settings.threads is not None:
        return settings.threads
    return max(1, cpus_available() // world)


def device_for(settings: Settings, rank: int) -> torch.device:
    if settings.device == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def build_context(
    workload: Workload, mode: str, settings: Settings, rank: int, world: int, run_root: Path
) -> ModeContext:
    torch.manual_seed(settings.seed)  # same initial weights in every mode
    device = device_for(settings, rank)
    model = workload.build().to(device)
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids)
    fused = True if MODES[mode].fused else None  # None: torch's default (foreach)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, fused=fused)
    gen = torch.Generator().manual_seed(settings.seed + 1000 * (rank + 1))  # per-rank data
    pool: list[Batch] = []
    for _ in range(settings.batches_per_mode):
        inputs, targets = workload.batch(gen)
        pool.append((inputs.to(device), targets.to(device)))
    return ModeContext(
        model=model,
        optimizer=optimizer,
        batches=itertools.cycle(pool),
        loss_fn=workload.loss,
        max_norm=settings.max_norm if settings.max_norm is not None else workload.clip_norm,
        run_dir=run_root / workload.name / f"world{world}" / mode,
        clock=synced_clock if device.type == "cuda" else time.perf_counter,
        phase_clock=time.perf_counter,
    )


def synced_clock() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def round_order(modes: list[str], seed: int, round_index: int) -> list[str]:
    """The modes of one round in shuffled order; identical on every rank."""
    order = list(modes)
    random.Random(f"{seed}:{round_index}").shuffle(order)
    return order


def watchdog_cpu_ms() -> tuple[int, float]:
    """Live trainguard watchdog threads of this process, and the CPU ms they used so far.

    They run in the background while every mode steps, so interleaving spreads their cost
    over all modes; this measures it separately (Linux; 10 ms granularity).
    """
    ticks, count = 0, 0
    for thread in threading.enumerate():
        if not thread.name.startswith("trainguard-watchdog") or not thread.native_id:
            continue
        try:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text(encoding="utf-8")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # fields from the 3rd on: utime, stime = 14, 15
        ticks += int(fields[11]) + int(fields[12])
        count += 1
    return count, 1e3 * ticks / os.sysconf("SC_CLK_TCK")


def interleave(
    runners: dict[str, Runner], settings: Settings, log: bool
) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Warm-up rounds, then timed rounds of one step per mode; None where a slow mode sat out.

    Also returns what the guards' background threads cost during the timed rounds."""
    names = list(runners)
    for r in range(settings.warmup):
        for name in round_order(names, settings.seed, -1 - r):
            runners[name].step()
    samples: dict[str, list[Any]] = {name: [] for name in names}
    _, cpu_before = watchdog_cpu_ms()
    started = time.monotonic()
    for r in range(settings.rounds):
        gc.collect()
        for name in round_order(names, settings.seed, r):
            if MODES[name].slow and r % settings.slow_every:
                samples[name].append(None)
            else:
                samples[name].append(runners[name].step())
        if log and (r + 1) % 10 == 0:
            elapsed = time.monotonic() - started
            print(f"  round {r + 1}/{settings.rounds} ({elapsed:.0f} s)", file=sys.stderr)
    threads, cpu_after = watchdog_cpu_ms()
    wall_s = time.monotonic() - started
    background = {
        "watchdog_threads": threads,
        "watchdog_cpu_ms": cpu_after - cpu_before,
        "wall_s": wall_s,
        "watchdog_core_percent_each": 100
        * (cpu_after - cpu_before)
        / 1e3
        / wall_s
        / max(1, threads),
    }
    return samples, background


def measure_workload(
    workload: Workload, settings: Settings, rank: int, world: int, run_root: Path
) -> dict[str, Any]:
    """Build every mode, interleave them, summarize (the summary is this rank's)."""
    runners = {
        mode: make_runner(mode, build_context(workload, mode, settings, rank, world, run_root))
        for mode in settings.modes
    }
    params = sum(p.numel() for p in runners[settings.modes[0]].ctx.model.parameters())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        samples, background = interleave(runners, settings, log=rank == 0)
    notes = {mode: runner.close() for mode, runner in runners.items()}
    return {
        "workload": workload.name,
        "description": workload.description.format(**workload.sizes),
        "sizes": workload.sizes,
        "parameters": params,
        "world": world,
        "threads": torch.get_num_threads(),
        "device": str(device_for(settings, rank)),
        "rounds": settings.rounds,
        "warmup": settings.warmup,
        "modes": {mode: summarize(mode, samples, notes[mode]) for mode in settings.modes},
        "background": background,
    }


AROUND = ("fetch", "pre", "check")
"""The phases around forward/backward, where a check does its work."""


def summarize(mode: str, samples: dict[str, list[Any]], notes: dict[str, Any]) -> dict[str, Any]:
    """Median step time; ratio and overhead against the reference, paired round by round."""
    mine = samples[mode]
    totals = [s["total"] for s in mine if s is not None]
    reference = MODES[mode].reference
    out: dict[str, Any] = {
        "description": MODES[mode].description,
        "reference": reference,
        "rounds_measured": len(totals),
        "median_ms": median(totals),
        "phases_ms": {p: median([s[p] for s in mine if s is not None]) for p in PHASES},
        "step_ms": [round(t, 3) for t in totals],
        "around_ms_rounds": [round(_around(s), 4) for s in mine if s is not None],
        **notes,
    }
    out.update(ratio=None, ratio_p25=None, ratio_p75=None, overhead_ms=None, around_ms=None)
    if reference is None or reference not in samples:
        return out
    pairs = [
        (s, ref)
        for s, ref in zip(mine, samples[reference], strict=True)
        if s is not None and ref is not None
    ]
    ratios = [s["total"] / ref["total"] for s, ref in pairs]
    p25, p75 = quartiles(ratios)
    out.update(
        ratio=median(ratios),
        ratio_p25=p25,
        ratio_p75=p75,
        overhead_ms=median([s["total"] - ref["total"] for s, ref in pairs]),
        around_ms=median([_around(s) - _around(ref) for s, ref in pairs]),
    )
    return out


def _around(sample: Sample) -> float:
    return sum(sample[p] for p in AROUND)


# -- processes --------------------------------------------------------------------------------


def run_single(workload: Workload, settings: Settings, run_root: Path) -> dict[str, Any]:
    torch.set_num_threads(threads_for(settings, 1))
    return measure_workload(workload, settings, 0, 1, run_root)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ddp_worker(
    rank: int,
    world: int,
    port: int,
    workload: Workload,
    settings: Settings,
    run_root: str,
    out: str,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_for(settings, world))
    backend = "nccl" if settings.device == "cuda" else "gloo"
    if settings.device == "cuda":
        torch.cuda.set_device(device_for(settings, rank))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        result = measure_workload(workload, settings, rank, world, Path(run_root))
        if rank == 0:
            write_json(Path(out), result)
    finally:
        dist.destroy_process_group()


def run_ddp(workload: Workload, settings: Settings, world: int, run_root: Path) -> dict[str, Any]:
    out = run_root / f"{workload.name}-world{world}.json"
    args = (world, _free_port(), workload, settings, str(run_root), str(out))
    start_processes(_ddp_worker, args=args, nprocs=world, join=True, start_method="spawn")
    result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return result
