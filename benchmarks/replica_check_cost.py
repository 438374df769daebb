"""What the replica agreement check costs (issue 24): 2-rank DDP on CPU (gloo).

Every ``replica_check_every`` steps each rank fingerprints its replicated weights (a float64
sum per parameter, on the device) and the number rides the step's all-reduce; the other
steps pay a cached zero. Compared step by step, in a shuffled order each round (the same on
both ranks), three guarded DDP runs of the same model:

- ``off``: ``replica_check_every=0``;
- ``default``: ``replica_check_every=100`` (the default);
- ``every_step``: ``replica_check_every=1`` (the check's cost in a step, undiluted).

Reported: mean ms per step of each run and the ratios to ``off`` (means, so the one check
in 100 steps counts; a 95% bootstrap interval over rounds); the time spent inside the
watch's ``fingerprint()`` and ``observe()`` as a share of the ``off`` step (a direct cost
the machine's noise does not blur); and one fingerprint alone (ms, one thread) on the
workload's model, to size the default cadence. The watchdog is off in every run
(``hang_timeout=0``): its cost is not this check's.

    python benchmarks/replica_check_cost.py                 # transformer, 200 rounds
    python benchmarks/replica_check_cost.py --quick         # tiny sizes (smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
from torch.multiprocessing.spawn import start_processes
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
from _common import bootstrap_ci, machine_info, markdown_table, median, now_iso, write_json
from overhead_modes import Batch, Workload, workloads

import trainguard as tg
from trainguard.config import GuardConfig
from trainguard.events import EventLog
from trainguard.health.replicas import ReplicaWatch

EVERY = {"off": 0, "default": GuardConfig.replica_check_every, "every_step": 1}
WORLD = 2


class Clock:
    """Seconds spent inside the wrapped methods."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, owner: Any, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)


def _endless(workload: Workload) -> Iterator[Batch]:
    gen = torch.Generator().manual_seed(0)
    batches = [workload.batch(gen) for _ in range(8)]
    i = 0
    while True:
        yield batches[i % len(batches)]
        i += 1


class Runner:
    """One guarded DDP run, stepped one step at a time."""

    def __init__(self, mode: str, workload: Workload, run_dir: Path) -> None:
        torch.manual_seed(0)
        self.model = DDP(workload.build())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=workload.lr)
        self.guard = tg.Guard(
            self.model, self.opt, run_dir=run_dir, hang_timeout=0, replica_check_every=EVERY[mode]
        )
        self.clock = Clock()
        self.clock.wrap(self.guard.replicas, "fingerprint")
        self.clock.wrap(self.guard.replicas, "observe")
        self._workload = workload
        self._batches = iter(self.guard.watch(_endless(workload)))

    def step(self) -> float:
        """Milliseconds of one step: fetch, forward, backward, check, update."""
        start = time.perf_counter()
        batch = next(self._batches)
        loss = self._workload.loss(self.model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        if self.guard.check(loss):
            self.opt.step()
        self.opt.zero_grad()
        return (time.perf_counter() - start) * 1e3


def interleave(workload: Workload, rounds: int, warmup: int, root: Path) -> dict[str, Any]:
    runners = {mode: Runner(mode, workload, root / mode) for mode in EVERY}
    for _ in range(warmup):
        for runner in runners.values():
            runner.step()
    clock_before = {mode: r.clock.seconds for mode, r in runners.items()}
    samples: dict[str, list[float]] = {mode: [] for mode in EVERY}
    for r in range(rounds):
        order = list(EVERY)
        random.Random(f"replicas:{r}").shuffle(order)  # the same on every rank
        for mode in order:
            samples[mode].append(runners[mode].step())
    inside = {m: (r.clock.seconds - clock_before[m]) * 1e3 / rounds for m, r in runners.items()}
    checks = {m: r.guard.replicas.checks for m, r in runners.items()}
    events = {
        m: sum(e["kind"] == "replica_divergence" for e in tg.read_events(root / m)) for m in EVERY
    }
    for runner in runners.values():
        runner.guard.close()
    return {"samples": samples, "inside_ms_per_step": inside, "checks": checks, "events": events}


def fingerprint_alone(workload: Workload, repeats: int) -> dict[str, Any]:
    """Milliseconds of one fingerprint of the workload's model (one thread, no process)."""
    torch.manual_seed(0)
    model = workload.build()
    opt = torch.optim.AdamW(model.parameters(), lr=workload.lr)
    with tempfile.TemporaryDirectory() as run_dir:
        config = GuardConfig(run_dir=run_dir, replica_check_every=1)
        watch = ReplicaWatch(model, opt, config, EventLog(Path(run_dir), 0), 0, WORLD, None)
        cpu = torch.device("cpu")
        watch.fingerprint(0, cpu)  # first use: the parameter list and the factors
        times = []
        for step in range(repeats):
            start = time.perf_counter()
            float(watch.fingerprint(step, cpu))
            times.append((time.perf_counter() - start) * 1e3)
    params = list(model.parameters())
    return {
        "ms": median(times),
        "ms_all": times,
        "parameters": len(params),
        "elements": sum(p.numel() for p in params),
    }


def _worker(rank: int, port: int, sizes: str, rounds: int, warmup: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    try:
        with tempfile.TemporaryDirectory() as root:
            result = interleave(workloads(sizes)["transformer"], rounds, warmup, Path(root))
        if rank == 0:
            write_json(Path(out), result)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def summarize(measured: dict[str, Any], alone: dict[str, Any]) -> dict[str, Any]:
    samples: dict[str, list[float]] = measured["samples"]
    rounds = len(samples["off"])
    mean = {mode: sum(v) / len(v) for mode, v in samples.items()}
    ratios: dict[str, Any] = {}
    for mode in ("default", "every_step"):

        def ratio(idx: list[int], mode: str = mode) -> float:
            return sum(samples[mode][i] for i in idx) / sum(samples["off"][i] for i in idx)

        ratios[f"{mode}/off"] = {
            "mean_ratio": mean[mode] / mean["off"],
            "ci95": bootstrap_ci(rounds, ratio),
        }
    inside = measured["inside_ms_per_step"]
    share = {mode: inside[mode] / mean["off"] for mode in inside}
    predicted = alone["ms"] / GuardConfig.replica_check_every / mean["off"]
    return {
        "ms_per_step_mean": mean,
        "ms_per_step_median": {mode: median(v) for mode, v in samples.items()},
        "ratios": ratios,
        "inside_watch_ms_per_step": inside,
        "inside_watch_share_of_off_step": share,
        "fingerprint_alone": alone,
        "fingerprint_share_at_default_cadence": predicted,
        "checks": measured["checks"],
        "divergence_events": measured["events"],
        "ms_per_step": samples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--note", default="", help="free text kept in the JSON (e.g. shared)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/replicas.json"))
    args = parser.parse_args(argv)
    sizes = "quick" if args.quick else "cpu"
    workload = workloads(sizes)["transformer"]
    torch.set_num_threads(1)
    alone = fingerprint_alone(workload, 5 if args.quick else 30)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        spawn_args = (_free_port(), sizes, args.rounds, args.warmup, str(out))
        start_processes(  # type: ignore[no-untyped-call]
            _worker, args=spawn_args, nprocs=WORLD, join=True, start_method="spawn"
        )
        measured = json.loads(out.read_text(encoding="utf-8"))
    summary = summarize(measured, alone)
    results = {
        "machine": machine_info(),
        "time": now_iso(),
        "note": args.note,
        "workload": workload.description.format(**workload.sizes),
        "world_size": WORLD,
        "threads_per_rank": 1,
        "rounds": args.rounds,
        "warmup": args.warmup,
        **summary,
    }
    rows: list[list[object]] = []
    for key, value in summary["ratios"].items():
        low, high = value["ci95"]
        rows.append([key, value["mean_ratio"], low, high])
    print(markdown_table(["ratio (mean ms/step)", "value", "ci95 low", "ci95 high"], rows))
    share = summary["inside_watch_share_of_off_step"]
    print(
        f"off: {summary['ms_per_step_mean']['off']:.1f} ms/step; one fingerprint alone: "
        f"{alone['ms']:.2f} ms ({alone['parameters']} parameters, {alone['elements']} values); "
        f"inside the watch per step: default {100 * share['default']:.3f}%, "
        f"every step {100 * share['every_step']:.2f}% of a step"
    )
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
