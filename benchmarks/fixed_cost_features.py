"""What each default feature adds to the guard's fixed cost of a step (issue 26).

``fixed_cost.py`` times the guard with every default feature on. This times it with one
default feature taken out at a time, in one process, on the same 16-32-1 MLP loop
(``_fixed_cost_loops.py``: ``watch()``, forward, backward, ``check()``, Adam), interleaved
round by round with the bare loop, so that each feature's share of the cost is measured in
the loop it runs in (a call between two training steps costs several times what it costs in
a loop of its own: docs/benchmarks.md, "Round 5"). Modes:

- ``bare``: no guard; ``guard``: every default feature on;
- ``no_input_check``: ``check_inputs=False``; ``no_stragglers``: ``detect_stragglers=False``;
  ``no_spike_rule``: ``on_spike="off"``;
- ``no_history``: the step record (history ring and metrics log) replaced by a no-op, which
  no option does (measurement only);
- ``no_watch``: the loop iterates its data itself (no ``watch()``: no lookahead, no data
  accounting, and the input check has no batch to look at);
- ``none_of_these``: all of the above out at once (the step-start hook, the RNG snapshot and
  the fused finite check of the loss and gradients stay).

``fixed us`` is the median over rounds of (mode - bare) per step; ``feature us`` is what the
feature adds: ``guard``'s fixed cost minus the mode's.

    python benchmarks/fixed_cost_features.py --pin 1 --rounds 30
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from _common import load_average, machine_info, markdown_table, median, now_iso, write_json
from _fixed_cost_loops import BATCH, DIM_IN, HIDDEN, Batch, build_model, make_batches
from torch import nn

import trainguard as tg

DEFAULT_OUT = Path(__file__).parent / "results" / "cpu" / "fixed_cost_features.json"

Patch = Callable[[tg.Guard], None]


def _no_history(guard: tg.Guard) -> None:
    guard.history.add = lambda *args, **kwargs: None  # type: ignore[method-assign,assignment]


MODES: dict[str, tuple[dict[str, Any] | None, Patch | None, bool]] = {
    # mode: (GuardConfig options or None for no guard, a patch, whether the loop uses watch())
    "bare": (None, None, False),
    "guard": ({}, None, True),
    "no_input_check": ({"check_inputs": False}, None, True),
    "no_stragglers": ({"detect_stragglers": False}, None, True),
    "no_spike_rule": ({"on_spike": "off"}, None, True),
    "no_history": ({}, _no_history, True),
    "no_watch": ({}, None, False),
    "none_of_these": (
        {"check_inputs": False, "detect_stragglers": False, "on_spike": "off"},
        _no_history,
        False,
    ),
}


class FeatureLoop:
    """One mode's loop; ``run(n)`` takes ``n`` steps."""

    def __init__(self, mode: str, seed: int, run_dir: Path) -> None:
        options, patch, watched = MODES[mode]
        self.model = build_model(seed)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.loss_fn = nn.MSELoss()
        data: Iterator[Batch] = itertools.cycle(make_batches(seed + 1))
        self.guard: tg.Guard | None = None
        if options is not None:
            config = tg.GuardConfig(run_dir=run_dir / mode, **options)
            self.guard = tg.Guard(self.model, self.opt, config=config)
            if patch is not None:
                patch(self.guard)
            if watched:
                data = iter(self.guard.watch(data))
        self.batches = data

    def run(self, steps: int) -> None:
        batches, model, opt, loss_fn, guard = (
            self.batches,
            self.model,
            self.opt,
            self.loss_fn,
            self.guard,
        )
        for _ in range(steps):
            x, y = next(batches)
            loss = loss_fn(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            if guard is None or guard.check(loss):
                opt.step()
            opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()


def measure(
    loops: dict[str, FeatureLoop], rounds: int, warmup: int, steps: int
) -> dict[str, list[float]]:
    """Microseconds a step per mode and round; each round runs every mode once, in turn."""
    per_step: dict[str, list[float]] = {mode: [] for mode in loops}
    for round_index in range(warmup + rounds):
        for mode, loop in loops.items():
            start = time.perf_counter()
            loop.run(steps)
            elapsed = (time.perf_counter() - start) / steps * 1e6
            if round_index >= warmup:
                per_step[mode].append(elapsed)
    return per_step


def summarize(per_step: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    bare = per_step["bare"]
    fixed = {
        mode: median([t - b for t, b in zip(times, bare, strict=True)])
        for mode, times in per_step.items()
    }
    return {
        mode: {
            "median_us": median(times),
            "fixed_us": fixed[mode],
            "feature_us": fixed["guard"] - fixed[mode],
        }
        for mode, times in per_step.items()
    }


def table(summary: dict[str, dict[str, float]]) -> str:
    rows = [
        [
            mode,
            round(entry["median_us"], 1),
            None if mode == "bare" else round(entry["fixed_us"], 1),
            None if mode in ("bare", "guard") else round(entry["feature_us"], 1),
        ]
        for mode, entry in summary.items()
    ]
    return markdown_table(["mode", "us/step", "fixed us", "feature us"], rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds (default 3)")
    parser.add_argument("--steps", type=int, default=200, help="steps per block (default 200)")
    parser.add_argument("--quick", action="store_true", help="a smoke test (3 short rounds)")
    parser.add_argument("--pin", type=int, metavar="CPU", help="pin the process to this CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.steps = 3, 1, 20
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    torch.set_num_threads(1)
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="tg-features-") as tmp:
        loops = {mode: FeatureLoop(mode, args.seed, Path(tmp)) for mode in MODES}
        gc.collect()
        per_step = measure(loops, args.rounds, args.warmup, args.steps)
        for loop in loops.values():
            loop.close()
    summary = summarize(per_step)
    print(table(summary))
    report = {
        "benchmark": "fixed_cost_features",
        "date": now_iso(),
        "command": shlex.join(
            ["python", "benchmarks/fixed_cost_features.py", *(argv or sys.argv[1:])]
        ),
        "settings": {
            "rounds": args.rounds,
            "warmup": args.warmup,
            "steps_per_block": args.steps,
            "pinned_cpu": args.pin,
            "model": f"MLP {DIM_IN}-{HIDDEN}-1, batch {BATCH}, Adam, MSE",
        },
        "machine": machine_info(),
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "modes": summary,
        "per_step_us": per_step,
    }
    write_json(args.out, report)
    print(f"\nJSON: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
