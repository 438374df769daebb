"""What putting back a skipped step's buffers costs on good steps (issue 23).

The guard copies, at each step's first forward, the buffers that the forward changes
(``trainguard.step.buffers``), so that a skipped step can put them back. On a good step that
copy is the whole cost. Compared in the same rounds, in random order each round:

- ``bare``: the training loop without trainguard;
- ``guard``: ``tg.Guard`` with its defaults (buffers restored on a skip);
- ``guard_no_restore``: the same guard with ``restore_buffers=False``.

Workloads: ``transformer`` (the GPT-style model of ``overhead.py``: LayerNorm only, so no
buffer changes, the copy should be free) and ``bnconv`` (a small CPU conv net with three
BatchNorm2d layers, whose running statistics the forward writes every step).

Also the forward pre-hook that records the step's start: the time of one no-op hook call
(the calls after the first in a step) and of ``autocast_state()`` (once per step).

    python benchmarks/buffer_restore_cost.py                 # 7 rounds
    python benchmarks/buffer_restore_cost.py --quick         # tiny sizes (smoke test)
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).parent))
from _bnconv import BNConv
from _common import machine_info, markdown_table, median, now_iso, quartiles, write_json
from overhead_modes import workloads

import trainguard as tg
from trainguard.step.start import autocast_state

MODES = ("bare", "guard", "guard_no_restore")
Batch = tuple[Tensor, Tensor]


class Job:
    """A workload: a model factory, batches, and the loss."""

    def __init__(self, name: str, quick: bool) -> None:
        self.name = name
        gen = torch.Generator().manual_seed(0)
        if name == "bnconv":
            size, width, batch = (8, 4, 4) if quick else (32, 32, 32)
            self._build: Callable[[], nn.Module] = lambda: BNConv(width)
            self.batches = [
                (torch.randn(batch, 3, size, size, generator=gen), torch.randint(0, 10, (batch,)))
                for _ in range(8)
            ]
            self._loss: Callable[[nn.Module, Batch], Tensor] = lambda m, b: F.cross_entropy(
                m(b[0]), b[1]
            )
        else:
            workload = workloads("quick" if quick else "cpu")["transformer"]
            self._build = workload.build
            self.batches = [workload.batch(gen) for _ in range(8)]
            self._loss = workload.loss
        torch.manual_seed(0)
        self.initial = self._build()

    def model(self) -> nn.Module:
        return copy.deepcopy(self.initial)

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        return self._loss(model, batch)


class HookClock:
    """Times the guard's step-start work inside a run (copy of the changed buffers, RNG and
    autocast state at the first forward; learning which buffers changed at the decision): a
    direct cost that the machine's run-to-run noise does not blur."""

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


def run_mode(job: Job, mode: str, steps: int, warmup: int, clock: HookClock | None = None) -> float:
    """Median milliseconds per step of ``steps`` timed steps after ``warmup``."""
    model = job.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [job.batches[i % len(job.batches)] for i in range(steps + warmup)]
    times: list[float] = []
    with tempfile.TemporaryDirectory() as run_dir:
        guard = None
        if mode != "bare":
            restore = mode == "guard"
            config = tg.GuardConfig(run_dir=run_dir, hang_timeout=0, restore_buffers=restore)
            guard = tg.Guard(model, opt, config=config)
            if clock is not None:
                clock.wrap(guard._start, "begin")
                clock.wrap(guard._start.buffers, "learn")
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
    return median(times)


def hook_costs(repeats: int = 20000) -> dict[str, float]:
    """Microseconds: a no-op pre-hook call (the step already started) and autocast_state()."""
    model = nn.Linear(4, 4)
    with tempfile.TemporaryDirectory() as run_dir:
        guard = tg.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=run_dir)
        start_part = guard._start
        start_part.begin(guard.state.step)
        t0 = time.perf_counter()
        for _ in range(repeats):
            start_part._pre_hook(model, (), {})
        hook = (time.perf_counter() - t0) / repeats * 1e6
        t0 = time.perf_counter()
        for _ in range(repeats):
            autocast_state("cpu")
        autocast = (time.perf_counter() - t0) / repeats * 1e6
        guard.close()
    return {"noop_hook_us": hook, "autocast_state_us": autocast}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=0, help="timed steps per mode and round")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/buffers.json"))
    args = parser.parse_args(argv)
    rng = random.Random(0)
    results: dict[str, Any] = {"machine": machine_info(), "time": now_iso(), "workloads": {}}
    rows: list[list[object]] = []
    for name in ("transformer", "bnconv"):
        job = Job(name, args.quick)
        steps = args.steps or (4 if args.quick else (15 if name == "transformer" else 60))
        per_mode: dict[str, list[float]] = {mode: [] for mode in MODES}
        for mode in MODES:  # a discarded round: first-use costs (allocator, imports)
            run_mode(job, mode, 2, warmup=1)
        hook_ms: dict[str, list[float]] = {"guard": [], "guard_no_restore": []}
        for _ in range(args.rounds):
            order = list(MODES)
            rng.shuffle(order)
            for mode in order:
                clock = HookClock() if mode != "bare" else None
                per_mode[mode].append(run_mode(job, mode, steps, warmup=3, clock=clock))
                if clock is not None:
                    hook_ms[mode].append(clock.seconds * 1e3 / (steps + 3))
        ratios = {
            "guard/bare": [g / b for g, b in zip(per_mode["guard"], per_mode["bare"], strict=True)],
            "guard/no_restore": [
                g / n for g, n in zip(per_mode["guard"], per_mode["guard_no_restore"], strict=True)
            ],
        }
        share = {
            mode: median(values) / median(per_mode["bare"]) for mode, values in hook_ms.items()
        }
        results["workloads"][name] = {
            "ms_per_step": per_mode,
            "ratios": ratios,
            "steps": steps,
            "step_start_ms_per_step": hook_ms,
            "step_start_share_of_bare_step": share,
        }
        for key, values in ratios.items():
            low, high = quartiles(values)
            rows.append([name, key, median(values), low, high, median(per_mode["bare"])])
        for mode, values in hook_ms.items():
            rows.append([name, f"{mode}: step-start ms", median(values), None, None, None])
            rows.append([name, f"{mode}: step-start share", share[mode], None, None, None])
    results["hooks"] = hook_costs(2000 if args.quick else 20000)
    results["rounds"] = args.rounds
    print(markdown_table(["workload", "ratio", "median", "q25", "q75", "bare ms/step"], rows))
    print(
        f"no-op pre-hook call: {results['hooks']['noop_hook_us']:.2f} us; "
        f"autocast_state(): {results['hooks']['autocast_state_us']:.2f} us (once per step)"
    )
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
