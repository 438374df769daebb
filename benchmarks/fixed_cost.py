"""The guard's fixed host cost per step, on a model so small that the cost is all there is.

A 16-32-1 MLP (batch 32, Adam, MSE) takes steps of a few hundred microseconds on a CPU;
there the guard's per-step bookkeeping is not hidden behind compute. Modes, each with its own
model (same initial weights), optimizer and endless batch stream, built up front:

- ``bare``: forward, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``;
- ``naive_loss``: bare plus ``torch.isfinite(loss).item()`` before the update;
- ``naive_norm``: bare plus the torchtitan-style check: the gradient norm
  (``clip_grad_norm_(max_norm=inf)``: no clipping) and one ``.item()`` of
  ``isfinite([loss, norm])``;
- ``minimal``: the floor, a flat hand-written check of what the guard must at least do per
  step in one process, with no policy, events, capture or log around it: an RNG snapshot at
  the step's first forward (a forward pre-hook on the model, ``RngSnapshot.take()``),
  ``_foreach_norm`` of the gradients, ``aminmax`` of each input, one ``stack`` of
  ``[loss, norms..., ends...]``, one ``.tolist()``, the norm and finiteness on the host, a
  tuple appended to a ring; the gap between it and ``guard_check`` is the guard's own
  structure;
- ``guard_check``: a default ``Guard(model, opt, run_dir=...)`` (every default feature on),
  ``for batch in guard.watch(...)`` and ``if guard.check(loss): optimizer.step()``;
- ``guard_step``: the same guard with ``guard.step(loss)``;
- ``guard_every_line``: ``guard_check`` with ``metrics_lines_per_second=math.inf``: the
  metrics log keeps a line per step, as before the log was thinned by the loop's rate
  (round 8). The guards' first 1,000 steps (3 warm-up rounds and the first 2 timed ones at
  the default 200 steps) keep every line in every mode; the median of the rounds is the
  steady state of a longer run.

Round after round, every mode runs a block of ``--steps`` steps, in a freshly shuffled order,
so drift of the (shared) machine hits every mode alike. Per mode: the median microseconds
per step over the rounds; the guard's *fixed cost* is the median over rounds of
``guarded - bare`` per step, the ratio the median of the per-round ratios; the verdict
against issue 26's target (``TARGET_US``) is printed and kept as ``"target"``. ``--world 2`` runs
the bare and guarded modes in 2-rank DDP on gloo instead (each rank one thread).

The breakdown (``--breakdown``, on by default): where the guard's microseconds go. The loop's
phases (next batch, forward + backward, check, update) timed around each call in a bare
loop, a control (the bare loop plus about 100 us of unrelated Python where the guard checks:
does any Python between two steps slow the user's own forward and update?) and a guarded
loop, interleaved, and inside the guard per-part timers: named methods of the guard's parts are
wrapped in a timer (inclusive times; the timer's own cost is measured and subtracted).

    python benchmarks/fixed_cost.py                      # 40 rounds of 200 steps
    python benchmarks/fixed_cost.py --quick              # a smoke test
    python benchmarks/fixed_cost.py --pin 1              # pinned to CPU 1
    python benchmarks/fixed_cost.py --world 2            # 2-rank gloo, for reference
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
from _fixed_cost_breakdown import breakdown, breakdown_table
from _fixed_cost_loops import BATCH, DIM_IN, DIST_MODES, HIDDEN, MODES, Loop

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cpu" / "fixed_cost.json"

# -- interleaved rounds ----------------------------------------------------------------------


def measure(
    loops: dict[str, Loop], rounds: int, warmup: int, steps: int, seed: int
) -> dict[str, list[float]]:
    """Microseconds per step of every mode, one value per round (shuffled order each round;
    with ``seed`` shared by the ranks the order is the same on every rank)."""
    order = list(loops)
    rng = random.Random(seed)
    per_step: dict[str, list[float]] = {mode: [] for mode in loops}
    for index in range(warmup + rounds):
        rng.shuffle(order)
        for mode in order:
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            loops[mode].run(steps)
            elapsed = time.perf_counter() - start
            if index >= warmup:
                per_step[mode].append(1e6 * elapsed / steps)
    return per_step


def summarize(per_step: dict[str, list[float]]) -> dict[str, Any]:
    """Per mode: median and quartiles of us/step; per guarded/naive mode: the fixed cost
    (median of per-round differences to bare, 95% bootstrap interval) and the ratio."""
    bare = per_step["bare"]
    n = len(bare)
    modes: dict[str, Any] = {}
    for mode, values in per_step.items():
        q1, q3 = quartiles(values)
        entry: dict[str, Any] = {
            "us_per_step": values,
            "median_us": median(values),
            "q1_us": q1,
            "q3_us": q3,
        }
        if mode != "bare":
            diffs = [v - b for v, b in zip(values, bare, strict=True)]
            ratios = [v / b for v, b in zip(values, bare, strict=True)]
            entry["fixed_cost_us"] = median(diffs)
            entry["fixed_cost_ci95_us"] = bootstrap_ci(n, functools.partial(_median_of, diffs))
            entry["ratio"] = median(ratios)
        modes[mode] = entry
    return modes


def _median_of(values: list[float], indices: list[int]) -> float:
    return median([values[i] for i in indices])


# -- 2-rank gloo ------------------------------------------------------------------------------


def _dist_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with tempfile.TemporaryDirectory(prefix="tg-fixed-") as tmp:
            loops = {mode: Loop(mode, args.seed, Path(tmp), ddp=True) for mode in DIST_MODES}
            per_step = measure(loops, args.rounds, args.warmup, args.steps, args.seed)
            for loop in loops.values():
                loop.close()
        if rank == 0:
            out.put(per_step)
    finally:
        dist.destroy_process_group()


def run_dist(args: argparse.Namespace, world: int = 2) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + random.Random().randrange(2000)
    procs = [
        ctx.Process(target=_dist_worker, args=(r, world, port, args, queue)) for r in range(world)
    ]
    for proc in procs:
        proc.start()
    result: dict[str, list[float]] = queue.get(timeout=3600)
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"rank exited with {proc.exitcode}")
    return result


# -- report -----------------------------------------------------------------------------------


TARGET_US = 50.0
"""Issue 26: the guard's fixed cost per step, every default feature on, at most this."""


def target_verdict(modes: dict[str, Any]) -> dict[str, Any]:
    """guard_check's fixed cost against ``TARGET_US``, with the floor (``minimal``) beside it:
    met only when the whole 95% interval is under the target."""
    guard = modes["guard_check"]
    low, high = guard.get("fixed_cost_ci95_us") or (None, None)
    met = high is not None and high <= TARGET_US
    floor = modes.get("minimal", {}).get("fixed_cost_us")
    text = (
        f"guard_check fixed cost {guard['fixed_cost_us']:.0f} us (95% CI {low:.0f} .. "
        f"{high:.0f}) vs <= {TARGET_US:.0f} us: {'met' if met else 'NOT met'}"
        + (f"; the hand-written floor (minimal) costs {floor:.0f} us" if floor is not None else "")
    )
    return {
        "limit_us": TARGET_US,
        "guard_check_us": guard["fixed_cost_us"],
        "met": met,
        "minimal_us": floor,
        "text": text,
    }


def table(modes: dict[str, Any]) -> str:
    rows = []
    for mode, entry in modes.items():
        ci = entry.get("fixed_cost_ci95_us")
        rows.append(
            [
                mode,
                round(entry["median_us"], 1),
                round(entry["q1_us"], 1),
                round(entry["q3_us"], 1),
                None if "fixed_cost_us" not in entry else round(entry["fixed_cost_us"], 1),
                None if ci is None else f"{ci[0]:.1f} .. {ci[1]:.1f}",
                None if "ratio" not in entry else round(entry["ratio"], 3),
            ]
        )
    headers = ["mode", "us/step", "q1", "q3", "fixed cost us", "95% CI", "ratio to bare"]
    return markdown_table(headers, rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="timed rounds (default 40; 3 with --quick)")
    parser.add_argument("--warmup", type=int, help="untimed rounds (default 3; 1 with --quick)")
    parser.add_argument("--steps", type=int, help="steps per block (default 200; 20 --quick)")
    parser.add_argument("--quick", action="store_true", help="a smoke test")
    parser.add_argument("--world", type=int, choices=(1, 2), default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--pin", type=int, metavar="CPU", help="pin the process to this CPU")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="a note stored in the JSON (e.g. before)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 40
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.steps is None:
        args.steps = 20 if args.quick else 200
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    torch.set_num_threads(args.threads)
    load_start = load_average()
    report: dict[str, Any] = {
        "benchmark": "fixed_cost",
        "label": args.label,
        "date": now_iso(),
        "command": shlex.join(["python", "benchmarks/fixed_cost.py", *(argv or sys.argv[1:])]),
        "settings": {
            "rounds": args.rounds,
            "warmup": args.warmup,
            "steps_per_block": args.steps,
            "world": args.world,
            "threads": args.threads,
            "pinned_cpu": args.pin,
            "model": f"MLP {DIM_IN}-{HIDDEN}-1, batch {BATCH}, Adam, MSE",
        },
        "machine": machine_info(),
        "load_average_start": load_start,
    }
    with tempfile.TemporaryDirectory(prefix="tg-fixed-") as tmp:
        if args.world == 2:
            per_step = run_dist(args)
        else:
            loops = {mode: Loop(mode, args.seed, Path(tmp)) for mode in MODES}
            gc.collect()
            per_step = measure(loops, args.rounds, args.warmup, args.steps, args.seed)
            for loop in loops.values():
                loop.close()
        report["modes"] = summarize(per_step)
        report["target"] = target_verdict(report["modes"])
        print(table(report["modes"]))
        print(f"\ntarget: {report['target']['text']}")
        if args.breakdown and args.world == 1:
            rounds = max(3, args.rounds // 4)
            report["breakdown"] = breakdown(args.seed, args.steps, rounds, Path(tmp))
            print()
            print(breakdown_table(report["breakdown"]))
    report["load_average_end"] = load_average()
    write_json(args.out, report)
    print(
        f"\nload average {load_start} -> {report['load_average_end']}; JSON: {args.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
