"""What does recovery cost: snapshots and checkpoints on healthy steps, a rollback, a resume?

The transformer workload (``_workloads.py``, AdamW, one process). Healthy steps, in
interleaved rounds (each round every mode runs a block of ``--steps`` steps, in a shuffled
order; each mode keeps its model, optimizer and guard across rounds):

- ``bare``; ``bare+deepcopy``: the naive snapshot, ``copy.deepcopy`` of the model's and the
  optimizer's ``state_dict`` every ``--snapshot-every`` steps; ``bare+torch.save``: the naive
  checkpoint, ``torch.save`` of both every ``--checkpoint-every`` steps;
- ``guard``: ``tg.Guard`` defaults (no recovery); ``guard+snapshots``:
  ``on_escalation="rollback"``, in-memory snapshots every ``--snapshot-every`` steps;
  ``guard+checkpoints``: and known-good checkpoints on disk (``torch.distributed.checkpoint``)
  every ``--checkpoint-every`` steps.

Per mode: ms per step (median over rounds), the ratio to its reference (median of the
per-round ratios, 95% bootstrap interval) and the cost of one snapshot or checkpoint (the
extra ms per step times the cadence). Then the events, ``--runs`` times each:

- ``rollback``: a guard with ``on_escalation="rollback"`` and ``max_consecutive=1`` meets a
  NaN loss after a good snapshot: the time of that step's ``check()`` (restoring weights,
  optimizer, RNG, data position; ``capture=False``), against the naive restore
  (``load_state_dict`` of a deep copy);
- ``resume``: ``tg.Guard(..., resume=True)`` from a run folder holding a good checkpoint,
  against the same ``Guard`` built without it and the naive ``torch.load`` +
  ``load_state_dict``.

    python benchmarks/recovery_cost.py                  # cpu sizes, 5 rounds of 100 steps
    python benchmarks/recovery_cost.py --device cuda    # GPU sizes: pinned, sync-free copies
    python benchmarks/recovery_cost.py --quick          # tiny sizes: a smoke run
"""

from __future__ import annotations

import copy
import itertools
import logging
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    finish,
    finish_args,
    header,
    interleave,
    interval,
    markdown_table,
    median,
    paired,
    parser,
    synchronize,
)
from _workloads import Batch, Workload, workload

import trainguard as tg

NAME = "recovery_cost"
MODES: dict[str, str | None] = {
    "bare": None,
    "bare+deepcopy": "bare",
    "bare+torch.save": "bare",
    "guard": "bare",
    "guard+snapshots": "guard",
    "guard+checkpoints": "guard+snapshots",
}
"""Each mode and its reference."""


def _training(work: Workload, device: str, seed: int = 0) -> tuple[nn.Module, Any, Iterator[Batch]]:
    torch.manual_seed(seed)
    model = work.build().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=work.lr)
    gen = torch.Generator().manual_seed(seed + 1)
    pool = [tuple(t.to(device) for t in work.batch(gen)) for _ in range(8)]
    return model, opt, itertools.cycle(pool)  # type: ignore[arg-type]


def _guard(
    mode: str, model: nn.Module, opt: Any, run_dir: Path, args: Any, **more: Any
) -> tg.Guard:
    """A guard of ``mode``: options by the names ``tg.Guard`` takes as keywords."""
    options: dict[str, Any] = {"hang_timeout": 0, "capture": False}
    if mode != "guard":
        options.update(
            {"on_escalation": "rollback", "recovery.snapshot_every": args.snapshot_every}
        )
    if mode == "guard+checkpoints":
        options["checkpoint_every"] = args.checkpoint_every
    options.update(more)
    return tg.Guard(model, opt, run_dir=run_dir, **options)


class Mode:
    """One mode's training loop, kept across rounds; ``block()`` times ``steps`` steps."""

    def __init__(self, name: str, work: Workload, args: Any, root: Path) -> None:
        self.name, self.work, self.args, self.root = name, work, args, root
        self.model, self.opt, data = _training(work, args.device)
        self.guard: tg.Guard | None = None
        self.batches: Iterator[Batch] = data
        if name.startswith("guard"):
            self.guard = _guard(name, self.model, self.opt, root / name, args)
            self.batches = iter(self.guard.watch(data))
        self.step = 0
        self.kept: Any = None

    def block(self) -> float:
        """Milliseconds a step over a block of ``--steps`` steps."""
        work, model, opt, guard = self.work, self.model, self.opt, self.guard
        synchronize(self.args.device)
        start = time.perf_counter()
        for _ in range(self.args.steps):
            if self.name == "bare+deepcopy" and self.step % self.args.snapshot_every == 0:
                self.kept = copy.deepcopy((model.state_dict(), opt.state_dict()))
            if self.name == "bare+torch.save" and self.step % self.args.checkpoint_every == 0:
                state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                torch.save(state, self.root / "bare-checkpoint.pt")
            loss = work.loss(model, next(self.batches))
            loss.backward()  # type: ignore[no-untyped-call]
            if guard is None or guard.check(loss):
                opt.step()
            opt.zero_grad(set_to_none=True)
            self.step += 1
        synchronize(self.args.device)
        return 1e3 * (time.perf_counter() - start) / int(self.args.steps)

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()


def rollback_once(work: Workload, args: Any, run_dir: Path) -> dict[str, float]:
    """A good snapshot, then a NaN loss that escalates at once: the ``check()`` that rolls
    back, and the naive restore of a deep copy of the same state."""
    model, opt, data = _training(work, args.device)
    guard = _guard("guard+snapshots", model, opt, run_dir, args, max_consecutive=1, on_spike="off")
    stream = iter(guard.watch(data))
    for _ in range(args.snapshot_every + 3):  # a snapshot, and the healthy steps that judge it
        loss = work.loss(model, next(stream))
        loss.backward()  # type: ignore[no-untyped-call]
        if guard.check(loss):
            opt.step()
        opt.zero_grad(set_to_none=True)
    loss = work.loss(model, next(stream)) * float("nan")
    loss.backward()  # type: ignore[no-untyped-call]
    synchronize(args.device)
    start = time.perf_counter()
    ok = guard.check(loss)
    synchronize(args.device)
    rollback_s = time.perf_counter() - start
    opt.zero_grad(set_to_none=True)
    guard.close()
    events = [e for e in tg.read_events(run_dir) if e["kind"] == "rollback"]
    assert not ok and len(events) == 1, f"expected one rollback, got {len(events)}"
    kept = copy.deepcopy((model.state_dict(), opt.state_dict()))
    synchronize(args.device)
    start = time.perf_counter()
    model.load_state_dict(kept[0])
    opt.load_state_dict(kept[1])
    synchronize(args.device)
    return {"rollback": rollback_s, "naive restore": time.perf_counter() - start}


def resume_times(work: Workload, args: Any, root: Path) -> dict[str, list[float]]:
    """A run leaves good checkpoints; then, ``--runs`` times, a fresh model resumes from a
    copy of its folder (timed: the ``Guard`` constructor), against the constructor without
    ``resume`` and the naive ``torch.load`` + ``load_state_dict``."""
    source = root / "resume-source"
    model, opt, data = _training(work, args.device)
    first = _guard("guard+checkpoints", model, opt, source, args)
    for index, batch in enumerate(first.watch(data)):
        if index == 2 * args.checkpoint_every + 3:
            break
        loss = work.loss(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        if first.check(loss):
            opt.step()
        opt.zero_grad(set_to_none=True)
    first.close()
    plain = root / "plain.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, plain)
    out: dict[str, list[float]] = {"resume": [], "Guard() without resume": [], "naive load": []}
    for run in range(args.runs):
        for what in out:
            model, opt, _ = _training(work, args.device, seed=run + 1)
            run_dir = root / f"{what.split()[0].strip('()')}-{run}"
            if what == "resume":
                shutil.copytree(source, run_dir)
            guard: tg.Guard | None = None
            synchronize(args.device)
            start = time.perf_counter()
            if what == "naive load":
                state = torch.load(plain, map_location=args.device)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
            else:
                guard = _guard(
                    "guard+checkpoints", model, opt, run_dir, args, resume=what == "resume"
                )
            synchronize(args.device)
            out[what].append(time.perf_counter() - start)
            if guard is not None:
                guard.close()
        resumed = [e for e in tg.read_events(root / f"resume-{run}") if e["kind"] == "resume"]
        assert resumed, "the resumed guard wrote no resume event"
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, rounds=5, quick_rounds=2, warmup=1)
    p.add_argument("--steps", type=int, help="steps per block (default 100; 10 with --quick)")
    p.add_argument("--snapshot-every", type=int, help="default GuardConfig's (5 with --quick)")
    p.add_argument("--checkpoint-every", type=int, help="default 100 (10 with --quick)")
    p.add_argument("--runs", type=int, help="rollbacks and resumes timed (default 5; 2 --quick)")
    p.add_argument("--sizes", choices=("cpu", "gpu"), help="default: gpu on CUDA, else cpu")
    args = p.parse_args(argv)
    finish_args(p, args, NAME)
    args.steps = args.steps or (10 if args.quick else 100)
    args.snapshot_every = args.snapshot_every or (
        5 if args.quick else tg.GuardConfig().recovery.snapshot_every
    )
    args.checkpoint_every = args.checkpoint_every or (10 if args.quick else 100)
    args.runs = args.runs or (2 if args.quick else 5)
    sizes = "quick" if args.quick else (args.sizes or ("gpu" if args.device == "cuda" else "cpu"))
    logging.getLogger("trainguard").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")  # DCP warns that it saves in one process
    if args.device == "cpu":
        torch.set_num_threads(1)
    work = workload("transformer", sizes)
    settings = {
        "workload": work.description,
        "device": args.device,
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "snapshot_every": args.snapshot_every,
        "checkpoint_every": args.checkpoint_every,
        "runs": args.runs,
    }
    report = header(NAME, argv, settings)
    root = Path(tempfile.mkdtemp(prefix="tg-recovery-cost-"))
    try:
        modes = {name: Mode(name, work, args, root) for name in MODES}
        ms = interleave(list(MODES), lambda n: modes[n].block(), args.rounds, args.warmup)
        for mode in modes.values():
            mode.close()
        rollbacks = [rollback_once(work, args, root / f"rollback-{i}") for i in range(args.runs)]
        resumes = resume_times(work, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cadence = {"bare+deepcopy": args.snapshot_every, "guard+snapshots": args.snapshot_every}
    cadence |= {
        "bare+torch.save": args.checkpoint_every,
        "guard+checkpoints": args.checkpoint_every,
    }
    summary: dict[str, Any] = {}
    for name, ref in MODES.items():
        entry: dict[str, Any] = {
            "reference": ref,
            "ms_per_step": ms[name],
            "median_ms": median(ms[name]),
        }
        if ref is not None:
            entry.update(paired(ms[name], ms[ref]))
            if name in cadence:
                entry["ms_per_event"] = entry["diff"] * cadence[name]
        summary[name] = entry
    events_ms = {
        "rollback (guard.check of the escalating step)": [1e3 * r["rollback"] for r in rollbacks],
        "naive restore (load_state_dict of a deep copy)": [
            1e3 * r["naive restore"] for r in rollbacks
        ],
        "resume (Guard(..., resume=True))": [1e3 * s for s in resumes["resume"]],
        "Guard(...) without resume": [1e3 * s for s in resumes["Guard() without resume"]],
        "naive load (torch.load + load_state_dict)": [1e3 * s for s in resumes["naive load"]],
    }
    rows = [
        [n, e["reference"] or "", e["median_ms"], e.get("ratio"), interval(e.get("ratio_ci95")),
         e.get("diff"), e.get("ms_per_event")]
        for n, e in summary.items()
    ]  # fmt: skip
    print(f"{work.description}, AdamW, {args.device}; snapshot every {args.snapshot_every}, "
          f"checkpoint every {args.checkpoint_every} steps")  # fmt: skip
    headers = ["mode", "vs", "ms/step", "ratio", "95% CI", "+ms/step", "ms per snapshot/checkpoint"]
    print(markdown_table(headers, rows))
    print()
    event_rows = [[n, len(v), median(v), min(v), max(v)] for n, v in events_ms.items()]
    print(markdown_table(["event", "runs", "median ms", "min ms", "max ms"], event_rows))
    report.update(modes=summary, events_ms=events_ms)
    finish(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
