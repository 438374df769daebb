"""The built-in demo: a real multi-process run that hits the classic 0/0, is kept alive by
the guard, leaves a capture, and gets diagnosed by replay.

``run_demo()`` launches ``python -m torch.distributed.run --standalone`` (torch's elastic
launcher) with N CPU workers on gloo. Each worker trains a small classifier under DDP with a
class-balanced loss: the per-class sum of the losses divided by the per-class count. One
batch of one rank lacks a class, so its count is 0 and the loss is 0/0 = NaN. The guard
skips that step on every rank and captures it; the launcher exits; the parent replays the
bundle with :func:`make_replay` and returns the diagnosis. Progress comes from the rank-0
event log (``demo_progress`` events), which the caller renders.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainguard.errors import ConfigError, TrainGuardError
from trainguard.hang.flight_recorder import enable_by_default

RANKS = (1, 32)
"""``--ranks``: the allowed range (each rank is a CPU process)."""
STEPS = (5, 100_000)
"""``--steps``: the allowed range (the bad step is at 2/5 of the run)."""
CLASSES = 4
FEATURES = 8
BATCH = 16
MISSING_CLASS = 3


class DemoError(TrainGuardError):
    """The demo's training run failed (the message points at its log)."""


class DemoNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh()
        )
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.encoder(x))
        return out


def balanced_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Mean over classes of each class's mean loss: every class weighs the same."""
    per_sample = F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")
    sums = torch.zeros(CLASSES).index_add(0, batch["y"], per_sample)
    counts = torch.bincount(batch["y"], minlength=CLASSES).float()
    per_class = sums / counts  # 0/0 = NaN for a class with no sample in the batch
    return per_class.mean()


def make_replay() -> tuple[nn.Module, Callable[[nn.Module, Any], Tensor]]:
    """The replay factory: ``trainguard replay BUNDLE --factory trainguard.demo:make_replay``."""
    return DemoNet(), balanced_loss


# -- data ------------------------------------------------------------------------------------


def check_options(ranks: object, steps: object) -> None:
    """``ConfigError`` naming the option when ``ranks`` or ``steps`` is out of range."""
    for option, value, (low, high) in (("--ranks", ranks, RANKS), ("--steps", steps, STEPS)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(option, f"use an integer from {low} to {high} (got {value!r})")


def bad_step(steps: int) -> int:
    return steps * 2 // 5


class DemoData(torch.utils.data.Dataset[dict[str, Tensor]]):
    """Labels cycle through the classes, except in one batch of one rank, which lacks one."""

    def __init__(self, steps: int, world: int) -> None:
        n = steps * world * BATCH
        gen = torch.Generator().manual_seed(1234)
        labels = torch.arange(n) % CLASSES
        first = (bad_step(steps) * world + min(1, world - 1)) * BATCH
        block = labels[first : first + BATCH]
        block[block == MISSING_CLASS] = torch.arange(int((block == MISSING_CLASS).sum())) % (
            CLASSES - 1
        )
        centers = torch.randn(CLASSES, FEATURES, generator=gen) * 2
        self.x = centers[labels] + torch.randn(n, FEATURES, generator=gen)
        self.y = labels

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "y": self.y[i], "index": torch.tensor(i)}


class RankBatches(torch.utils.data.Sampler[list[int]]):
    """Step s of rank r reads samples [(s * world + r) * BATCH, ... + BATCH)."""

    def __init__(self, rank: int, world: int, steps: int) -> None:
        self.rank, self.world, self.steps = rank, world, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.steps):
            start = (step * self.world + self.rank) * BATCH
            yield list(range(start, start + BATCH))


# -- the worker (one process per rank, started by torch.distributed.run) -----------------------


def worker(run_dir: Path, steps: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import trainguard as tg

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(DemoNet())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = DemoData(steps, world)
    loader = torch.utils.data.DataLoader(data, batch_sampler=RankBatches(rank, world, steps))
    with tg.Guard(model, optimizer, run_dir=run_dir, on_nonfinite="skip") as guard:
        for batch in guard.watch(loader):
            step = guard.state.step
            loss = balanced_loss(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            ok = guard.check(loss)
            if ok:
                optimizer.step()
            optimizer.zero_grad()
            guard.events.write("demo_progress", step, loss=float(loss), ok=ok, steps=steps)
    dist.destroy_process_group()


# -- the parent --------------------------------------------------------------------------------


@dataclass
class DemoResult:
    run_dir: Path
    bundle: Path
    report: dict[str, Any]
    """The replay report (``ReplayReport.to_dict()``)."""
    train_seconds: float
    replay_seconds: float
    skipped: int
    final_loss: float | None
    missing_classes: list[int]
    """Classes absent from the replayed batch (the demo's own reading of element [k])."""


def launch_command(ranks: int, steps: int, run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={ranks}",
        "-m",
        "trainguard.demo",
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
    ]


def run_demo(
    ranks: int = 2,
    steps: int = 30,
    run_dir: Path | str = "runs/demo",
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> DemoResult:
    """Train under the elastic launcher, then replay the capture. ``on_event`` gets rank 0's
    events as they are written (for a progress display)."""
    from trainguard.events import read_events
    from trainguard.replay.runner import replay
    from trainguard.report.replays import save_replay_result

    check_options(ranks, steps)
    folder = Path(run_dir)
    _clear(folder)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "launch.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    enable_by_default(env)  # torch's flight recorder in the workers (hang reports)
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            launch_command(ranks, steps, folder), stdout=out, stderr=subprocess.STDOUT, env=env
        )
        _follow(proc, folder / "events" / "rank-0.jsonl", on_event)
    train_seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise DemoError(f"the training run failed (exit {proc.returncode}); see {log}")
    bundles = sorted((folder / "captures").glob("step-*"))
    if not bundles:
        raise DemoError(f"the training run left no capture under {folder / 'captures'}; see {log}")
    start = time.monotonic()
    report = replay(bundles[0], make_replay).to_dict()
    save_replay_result(bundles[0], report)  # for `trainguard report`
    replay_seconds = time.monotonic() - start
    events = read_events(folder, rank=0)
    progress = [e for e in events if e.get("kind") == "demo_progress"]
    return DemoResult(
        run_dir=folder,
        bundle=bundles[0],
        report=report,
        train_seconds=train_seconds,
        replay_seconds=replay_seconds,
        skipped=sum(1 for e in events if e.get("kind") == "skip"),
        final_loss=progress[-1]["loss"] if progress else None,
        missing_classes=_missing_classes(bundles[0], int(report.get("rank", 0))),
    )


OUTPUTS = (
    "events",
    "metrics",
    "captures",
    "hangs",
    "recovery",
    "stop.json",
    "launch.log",
    "report.html",
)
"""What a demo run leaves in its run dir (the guard's folders and stop record, the launcher's
log, the page of ``trainguard report``): a new demo removes them, and nothing else."""


def _clear(folder: Path) -> None:
    """A fresh run dir; only the demo's own outputs (``OUTPUTS``) are removed."""
    import shutil

    for name in OUTPUTS:
        target = folder / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


def _follow(
    proc: subprocess.Popen[bytes], events: Path, on_event: Callable[[dict[str, Any]], None] | None
) -> None:
    import json

    offset = 0
    while True:
        done = proc.poll() is not None
        if on_event is not None and events.exists():
            with events.open(encoding="utf-8") as fh:
                fh.seek(offset)
                while True:
                    line = fh.readline()
                    if not line.endswith("\n"):
                        break  # a line still being written: read it next time
                    offset = fh.tell()
                    try:
                        on_event(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        if done:
            return
        time.sleep(0.1)


def _missing_classes(bundle: Path, rank: int) -> list[int]:
    from trainguard.capture.bundle import load_bundle

    batch = load_bundle(bundle, verify=False).batches(rank)[0]
    present = set(batch["y"].tolist())
    return [c for c in range(CLASSES) if c not in present]


def main(argv: Sequence[str] | None = None) -> None:
    """Worker entry point (``python -m trainguard.demo``, started by the launcher)."""
    parser = argparse.ArgumentParser(prog="python -m trainguard.demo")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args(argv)
    worker(args.run_dir, args.steps)


if __name__ == "__main__":
    main()
