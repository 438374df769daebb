"""What ``Guard(rerun=loss_fn)`` costs (issue 25).

Good steps: the rerun keeps nothing beyond what the guard already keeps for a skip (the
step's batches by reference, its RNG and autocast state, the copies of the buffers its
forward writes), so ``guard_rerun`` / ``guard`` should be 1.00 within noise. Compared in the
same rounds, in random order each round: ``bare``, ``guard``, ``guard_rerun``.

A rerun step: within one ``guard_rerun`` run, a one-off NaN output at every 4th step (a
forward hook; the rerun is clean) makes those steps transient faults; their median time is
set against the median of the normal steps of the same run (about 2x: the step is computed
twice, plus one more agreement).

    python benchmarks/rerun_cost.py               # 7 rounds
    python benchmarks/rerun_cost.py --quick       # tiny sizes (smoke test)
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_info, markdown_table, median, now_iso, quartiles, write_json
from buffer_restore_cost import Job

import trainguard as tg

MODES = ("bare", "guard", "guard_rerun")


class EveryNth:
    """Poisons the module's output at the first call of every ``n``-th step (a transient)."""

    def __init__(self, module: nn.Module, n: int) -> None:
        self.n = n
        self.guard: tg.Guard | None = None
        self.done = -1
        module.register_forward_hook(self)

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        step = self.guard.state.step if self.guard is not None else -1
        if step > 0 and step % self.n == 0 and step != self.done:
            self.done = step
            return output * float("nan")
        return None


def run_mode(job: Job, mode: str, steps: int, warmup: int, every: int = 0) -> list[float]:
    """Milliseconds of each timed step."""
    model = job.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [job.batches[i % len(job.batches)] for i in range(steps + warmup)]
    hook = EveryNth(model, every) if every else None
    times: list[float] = []
    with tempfile.TemporaryDirectory() as run_dir:
        guard = None
        if mode != "bare":
            rerun = job.loss if mode == "guard_rerun" else None
            config = tg.GuardConfig(run_dir=run_dir, hang_timeout=0, suspect_host_after=0)
            guard = tg.Guard(model, opt, rerun=rerun, config=config)  # faults on purpose
            if hook is not None:
                hook.guard = guard
        batches = guard.watch(data) if guard is not None else iter(data)
        start = time.perf_counter()
        for i, batch in enumerate(batches):
            loss = job.loss(model, batch)
            loss.backward()
            if guard is None or guard.check(loss):
                opt.step()
            opt.zero_grad()
            end = time.perf_counter()
            if i >= warmup:
                times.append((end - start) * 1e3)
            start = end
        if guard is not None:
            guard.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/rerun.json"))
    args = parser.parse_args(argv)
    rng = random.Random(0)
    job = Job("transformer", args.quick)
    steps = 4 if args.quick else 12
    for mode in MODES:  # a discarded round: first-use costs
        run_mode(job, mode, 2, warmup=1)
    per_mode: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        order = list(MODES)
        rng.shuffle(order)
        for mode in order:
            per_mode[mode].append(median(run_mode(job, mode, steps, warmup=2)))
    ratios = [r / g for r, g in zip(per_mode["guard_rerun"], per_mode["guard"], strict=True)]
    over_bare = [g / b for g, b in zip(per_mode["guard"], per_mode["bare"], strict=True)]
    faulted = run_mode(job, "guard_rerun", 4 * (steps // 2), warmup=2, every=4)
    # timed entry i is step i + 2 of the run (after 2 warm-up steps): every 4th is rerun
    rerun_steps = [t for i, t in enumerate(faulted) if (i + 2) % 4 == 0]
    normal_steps = [t for i, t in enumerate(faulted) if (i + 2) % 4 != 0]
    rerun_ratio = median(rerun_steps) / median(normal_steps)
    low, high = quartiles(ratios)
    rows = [
        ["good steps: guard_rerun / guard", median(ratios), low, high],
        ["good steps: guard / bare", median(over_bare), *quartiles(over_bare)],
        ["a rerun step / a normal step (same run)", rerun_ratio, None, None],
    ]
    print(markdown_table(["ratio", "median", "q25", "q75"], rows))
    results = {
        "machine": machine_info(),
        "time": now_iso(),
        "rounds": args.rounds,
        "steps": steps,
        "ms_per_step": per_mode,
        "ratios": {"guard_rerun/guard": ratios, "guard/bare": over_bare},
        "rerun_step_ms": rerun_steps,
        "normal_step_ms": normal_steps,
        "rerun_step_ratio": rerun_ratio,
    }
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
