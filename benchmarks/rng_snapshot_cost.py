"""What the step-start RNG snapshot costs a step, with CUDA's generators when a GPU is there.

    python benchmarks/rng_snapshot_cost.py [--rounds 30] [--out FILE.json]

The guard takes ``RngSnapshot.take()`` at every step's first forward. Timed per call, in
interleaved rounds (each a block of ``--calls`` calls of one way, the ways in a shuffled
order each round), medians of the rounds:

- ``rng_state``: the plain copy a naive capture makes (``random.getstate()``, NumPy's
  ``get_state()``, torch's CPU and every CUDA generator's state);
- ``copy``: ``RngSnapshot()``, the raw copies of every generator; before the CUDA
  generators were fingerprinted, every step of a process with CUDA initialized paid this;
- ``take_unmoved``: ``RngSnapshot.take()`` when no generator moved (the fingerprint, then
  the last snapshot again): a step that draws nothing;
- ``take_moved``: ``take()`` after one draw on the device (CUDA) or the CPU: the
  fingerprint and a new copy, the draw itself timed apart (``draw``) and subtracted.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, markdown_table, median, now_iso, quartiles, write_json

from trainguard.capture.rng import RngSnapshot, rng_state


def _ways(device: torch.device) -> dict[str, Callable[[], object]]:
    draw_on = torch.empty(1, device=device)

    def draw() -> None:
        draw_on.uniform_()

    def take_moved() -> None:
        draw()
        RngSnapshot.take()

    return {
        "rng_state": rng_state,
        "copy": RngSnapshot,
        "take_unmoved": RngSnapshot.take,
        "draw": draw,
        "take_moved+draw": take_moved,
    }


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000, help="calls per block")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks/rng_snapshot_cost.json"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.init()  # type: ignore[no-untyped-call]
    np.random.seed(0)  # NumPy's global generator exists, as in a loop that uses it
    ways = _ways(device)
    times: dict[str, list[float]] = {name: [] for name in ways}
    order = list(ways)
    for round_ in range(args.rounds + 2):
        random.shuffle(order)
        for name in order:
            us = _per_call_us(ways[name], args.calls)
            if round_ >= 2:  # two warm-up rounds
                times[name].append(us)
    both = times.pop("take_moved+draw")
    times["take_moved"] = [b - d for b, d in zip(both, times["draw"], strict=True)]
    rows, result = [], {}
    for name, values in times.items():
        q1, q3 = quartiles(values)
        result[name] = {"us": values, "median_us": median(values), "q1_us": q1, "q3_us": q3}
        rows.append([name, median(values), q1, q3])
    info = machine_info()
    report: dict[str, Any] = {
        "benchmark": "rng_snapshot_cost",
        "date": now_iso(),
        "command": " ".join(["python", *sys.argv]),
        "settings": {"rounds": args.rounds, "calls": args.calls, "device": str(device)},
        "cuda_generators": len(torch.cuda.default_generators),
        "machine": info,
        "ways": result,
    }
    write_json(args.out, report)
    print(f"{info.get('cpu')}, torch {torch.__version__}, device {device}")
    print(markdown_table(["way", "us/call", "q1", "q3"], rows))
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
