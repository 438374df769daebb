"""What recovery costs on a healthy run: snapshots and checkpoints at their cadences.

The transformer workload of ``overhead_modes`` (AdamW), one process, timed in rounds that
alternate the modes (so drift on a shared machine hits each mode alike):

- ``bare``: the same loop without the guard;
- ``guard``: the guard alone;
- ``guard+snapshots``: ``on_escalation="rollback"``, in-memory snapshots every
  ``--snapshot-every`` steps (default: GuardConfig's);
- ``guard+snapshots+checkpoints``: and a known-good checkpoint on disk (DCP) every
  ``--checkpoint-every`` steps.

Then the blocking time of one checkpoint (``trainguard.recovery.checkpoint.save``: DCP,
per-rank extras, manifest, rename) against a plain ``torch.save`` of the same model and
optimizer state, ``--runs`` times each.

    python benchmarks/recovery_cost.py              # cpu sizes
    python benchmarks/recovery_cost.py --quick      # tiny sizes (smoke test)

Numbers from a shared machine are noisy: take the final ones on a quiet one. Whole runs of
the same mode differ by several percent here, so ``--blocks`` also times each recovery mode
within one run: its recovery hooks on in alternate ``--block``-step blocks and off (no-ops)
in the others, the ratio being the mean step time of the on blocks over the off blocks
(snapshot and checkpoint steps included, same run, same memory, same minute).

    python benchmarks/recovery_cost.py --blocks --rounds 3
"""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import machine_info, markdown_table, median, now_iso, write_json
from overhead_modes import Workload, workloads

import trainguard as tg
from trainguard.recovery import checkpoint as ckpt
from trainguard.recovery.snapshot import TrainingObjects

MODES = ("bare", "guard", "guard+snapshots", "guard+snapshots+checkpoints")
RECOVERY_HOOKS = ("step_boundary", "after_step")
"""The recovery part's per-step hooks: the snapshot copy and the checkpoint start (before a
step's first batch), marking good and retention (after the step's decision)."""


def _guard(mode: str, model: torch.nn.Module, opt: Any, run_dir: Path, args: Any) -> tg.Guard:
    config = tg.GuardConfig(run_dir=run_dir, hang_timeout=0, capture=False)
    if mode != "guard":
        config = tg.GuardConfig(
            run_dir=run_dir,
            hang_timeout=0,
            capture=False,
            on_escalation="rollback",
            snapshot_every=args.snapshot_every,
            checkpoint_every=args.checkpoint_every if mode.endswith("checkpoints") else 0,
        )
    return tg.Guard(model, opt, config=config)


def wrap_recovery_hooks(guard: tg.Guard, wrap: Callable[[str, Any], Any]) -> None:
    """Replace each of the recovery part's per-step hooks by ``wrap(name, hook)``, where the
    guard calls them: the step's first forward calls ``step_boundary`` through the guard's
    step-start record (``StepStart.on_begin``), ``watch()``'s stream until a hook fires."""
    recovery = guard.recovery
    for name in RECOVERY_HOOKS:
        setattr(recovery, name, wrap(name, getattr(recovery, name)))
    guard._start.on_begin = recovery.step_boundary  # type: ignore[union-attr]


class HookClock:
    """Wall time spent inside the recovery part's per-step hooks (``step_boundary``: the
    snapshot copy and the checkpoint start; ``after_step``: marking good, retention): the
    direct cost of recovery on the step, free of the step-to-step noise of a shared machine."""

    def __init__(self, guard: tg.Guard) -> None:
        self.seconds = 0.0
        wrap_recovery_hooks(guard, lambda _name, hook: self._timed(hook))

    def _timed(self, hook: Any) -> Any:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return hook(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def _training(work: Workload, steps: int) -> tuple[torch.nn.Module, Any, Any]:
    """The run's model, AdamW and ``steps + 2`` batches (8 distinct ones, cycled), seeded."""
    torch.manual_seed(0)
    model = work.build()
    opt = torch.optim.AdamW(model.parameters(), lr=work.lr)
    gen = torch.Generator().manual_seed(1)
    batches = [work.batch(gen) for _ in range(8)]
    return model, opt, (batches[i % len(batches)] for i in range(steps + 2))


def time_mode(mode: str, work: Workload, steps: int, root: Path, args: Any) -> tuple[float, float]:
    """Seconds per step over ``steps`` guarded steps (after 2 warm-up steps), and of those the
    seconds per step spent in the recovery hooks (0 without recovery)."""
    model, opt, data = _training(work, steps)
    if mode == "bare":
        return _time_bare(work, model, opt, data, steps), 0.0
    run_dir = root / f"{mode}-{time.monotonic_ns()}"
    guard = _guard(mode, model, opt, run_dir, args)
    hooks = HookClock(guard) if guard.recovery is not None else None
    start = 0.0
    with guard:
        for i, batch in enumerate(guard.watch(data)):
            if i == 2:
                start = time.perf_counter()
                if hooks is not None:
                    hooks.seconds = 0.0
            loss = work.loss(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            guard.step(loss)
    elapsed = time.perf_counter() - start
    shutil.rmtree(run_dir, ignore_errors=True)
    return elapsed / steps, (hooks.seconds / steps if hooks is not None else 0.0)


def time_blocks(
    mode: str, work: Workload, steps: int, root: Path, args: Any
) -> tuple[float, float, dict[str, dict[str, int]]]:
    """Mean seconds per step of the blocks with the recovery hooks on and of those with them
    off, in one run of ``mode`` (blocks of ``args.block`` steps, on first), and the hook calls
    that ran and that were skipped.

    The switch is installed before ``watch()`` starts (its stream keeps the ``step_boundary``
    it was given) and set for step ``i + 1`` at the end of step ``i``: the boundary hook of a
    step runs at that step's first forward (inside ``watch()`` before its batch is handed out,
    until a forward hook has fired)."""
    model, opt, data = _training(work, steps)
    run_dir = root / f"{mode}-blocks-{time.monotonic_ns()}"
    guard = _guard(mode, model, opt, run_dir, args)
    switch = HookSwitch(guard)
    times: dict[bool, list[float]] = {True: [], False: []}
    with guard:
        last = time.perf_counter()
        for i, batch in enumerate(guard.watch(data)):
            loss = work.loss(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            guard.step(loss)
            now = time.perf_counter()
            if i >= 2:
                times[(i // args.block) % 2 == 0].append(now - last)
            last = now
            switch.on = ((i + 1) // args.block) % 2 == 0
    shutil.rmtree(run_dir, ignore_errors=True)
    on, off = (sum(times[b]) / len(times[b]) for b in (True, False))
    return on, off, switch.calls


class HookSwitch:
    """The recovery part's per-step hooks, run only while ``on``."""

    def __init__(self, guard: tg.Guard) -> None:
        self.on = True
        self.calls = {name: {"ran": 0, "skipped": 0} for name in RECOVERY_HOOKS}
        """Calls of each hook that ran and that were skipped (the switch is really in use)."""
        wrap_recovery_hooks(guard, self._switched)

    def _switched(self, name: str, hook: Any) -> Any:
        def switched(*args: Any) -> Any:
            self.calls[name]["ran" if self.on else "skipped"] += 1
            return hook(*args) if self.on else None

        return switched


def blocks_table(work: Workload, steps: int, root: Path, args: Any) -> dict[str, Any]:
    """``--blocks``: each recovery mode ``args.rounds`` times; the per-run on/off ratios."""
    out: dict[str, Any] = {}
    for mode in MODES[2:]:
        runs = [time_blocks(mode, work, steps, root, args) for _ in range(args.rounds)]
        ratios = [on / off for on, off, _ in runs]
        out[mode] = {
            "on_ms": [on * 1e3 for on, _, _ in runs],
            "off_ms": [off * 1e3 for _, off, _ in runs],
            "hook_calls": [calls for _, _, calls in runs],
            "ratios": ratios,
            "ratio": median(ratios),
        }
    rows = [[m, median(v["on_ms"]), median(v["off_ms"]), v["ratio"]] for m, v in out.items()]
    print(markdown_table(["mode", "on blocks ms/step", "off blocks ms/step", "on / off"], rows))
    return out


def _time_bare(work: Workload, model: torch.nn.Module, opt: Any, data: Any, steps: int) -> float:
    start = 0.0
    for i, batch in enumerate(data):
        if i == 2:
            start = time.perf_counter()
        loss = work.loss(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps


def blocking_checkpoint(work: Workload, runs: int, root: Path) -> dict[str, float]:
    torch.manual_seed(0)
    model = work.build()
    opt = torch.optim.AdamW(model.parameters(), lr=work.lr)
    loss = work.loss(model, work.batch(torch.Generator().manual_seed(1)))
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()  # the moments exist
    objects = TrainingObjects(model, opt)
    saves, dcp, background = [], [], []
    for run in range(runs):
        path = root / f"plain-{run}.pt"
        start = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        ckpt.save(root / "ckpt", run + 1, objects, {}, None, 0)
        dcp.append(time.perf_counter() - start)
        start = time.perf_counter()
        saved = ckpt.save(root / "ckpt-async", run + 1, objects, {}, None, 0, use_async=True)
        background.append(time.perf_counter() - start)
        ckpt.finish(saved)  # outside the timing: the write runs behind the steps
    return {
        "torch_save_s": median(saves),
        "checkpoint_s": median(dcp),
        "checkpoint_async_s": median(background),
    }


def _ratio(times: dict[str, list[float]], mode: str, base: str) -> float:
    """The median of the per-round ratios (each round ran every mode once)."""
    return median([t / b for t, b in zip(times[mode], times[base], strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--snapshot-every", type=int, default=tg.GuardConfig().snapshot_every)
    parser.add_argument(
        "--checkpoint-every", type=int, default=None, help="default 100 (10 --quick)"
    )
    parser.add_argument("--blocks", action="store_true", help="also the within-run block test")
    parser.add_argument("--block", type=int, default=20, help="steps per block (--blocks)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recovery_cost.json"))
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")  # DCP warns that it saves in one process
    torch.set_num_threads(1)
    work = workloads("quick" if args.quick else "cpu")["transformer"]
    steps = args.steps or (20 if args.quick else 200)
    if args.checkpoint_every is None:
        args.checkpoint_every = 10 if args.quick else 100
    root = Path(tempfile.mkdtemp(prefix="tg-recovery-cost-"))
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    hooks: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        order = random.Random(0)
        for _ in range(args.rounds):
            modes = list(MODES)
            order.shuffle(modes)  # interleaved, in a new order each round
            for mode in modes:
                per_step, in_hooks = time_mode(mode, work, steps, root, args)
                times[mode].append(per_step)
                hooks[mode].append(in_hooks)
        blocking = blocking_checkpoint(work, args.runs, root)
        blocks = blocks_table(work, steps, root, args) if args.blocks else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [
        [
            mode,
            median(times[mode]) * 1e3,
            _ratio(times, mode, "bare"),
            _ratio(times, mode, "guard"),
            median(hooks[mode]) * 1e3,
            median([h / t for h, t in zip(hooks[mode], times["guard"], strict=True)]),
        ]
        for mode in MODES
    ]
    headers = ["mode", "ms/step (median)", "x bare", "x guard", "in recovery hooks ms/step"]
    print(markdown_table([*headers, "hooks / guard step"], rows))
    print(
        f"\nblocking time of one checkpoint: async_save {blocking['checkpoint_async_s'] * 1e3:.1f}"
        f" ms, synchronous {blocking['checkpoint_s'] * 1e3:.1f} ms (plain torch.save of the "
        f"same state: {blocking['torch_save_s'] * 1e3:.1f} ms)"
    )
    result = {
        "time": now_iso(),
        "machine": machine_info(),
        "workload": work.description.format(**work.sizes),
        "steps": steps,
        "rounds": args.rounds,
        "snapshot_every": args.snapshot_every,
        "checkpoint_every": args.checkpoint_every,
        "seconds_per_step": times,
        "ratio_to_bare": {row[0]: row[2] for row in rows},
        "ratio_to_guard": {row[0]: row[3] for row in rows},
        "recovery_hooks_seconds_per_step": hooks,
        "recovery_hooks_over_guard_step": {row[0]: row[5] for row in rows},
        "blocking": blocking,
        "blocks": blocks,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
