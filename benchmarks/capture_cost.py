"""What a capture costs on a bad step, and how long a replay takes.

A small MLP (``--width`` x ``--layers``, Adam) hits one bad step (an all-zero sample whose
row norm is 0 in ``blocks.0.norm``). Timed, each ``--runs`` times, in one process:

- ``torch.save(model.state_dict())``: the floor: plain weights, one file;
- ``torch.save(model + optimizer + batch)``: the same content as a bundle, one file, no
  fsync, no checksum;
- ``capture``: trainguard's bundle (5 files a rank, checksums, manifest, atomic rename): the
  time the training thread is blocked; the flush to disk runs in a background thread after
  that (joined outside the timing, so runs do not overlap);
- ``capture + fsync`` against ``torch.save(...) + fsync``: the same, durable on disk;
- ``load_bundle`` (every checksum verified);
- ``replay``: 3 repeats, the traced run and the bisection.

    python benchmarks/capture_cost.py                # default sizes
    python benchmarks/capture_cost.py --quick        # tiny sizes (smoke test)
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).parent))
from _common import (
    machine_info,
    markdown_table,
    median,
    now_iso,
    quartiles,
    replace_block,
    write_json,
)

import trainguard as tg
from trainguard.capture.rng import rng_state
from trainguard.events import EventLog
from trainguard.step.capturer import Capturer, StepEvidence, step_evidence
from trainguard.step.consensus import Agreement, Consensus
from trainguard.step.detect import grad_stats
from trainguard.step.policy import Decision

SIZES = {"width": 512, "layers": 4, "batch": 64}

Timings = dict[str, list[float]]
"""Seconds per run, by what was timed."""


class RowNorm(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x / x.norm(dim=-1, keepdim=True)
        return out


class Block(nn.Module):
    def __init__(self, width: int, first: bool) -> None:
        super().__init__()
        self.norm = RowNorm() if first else nn.Identity()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width, i == 0) for i in range(layers)])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    loss: Tensor = model(batch["x"]).pow(2).mean()
    return loss


def _time(fn: Callable[[], Any], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def interleaved(
    fns: dict[str, Callable[[], Any]],
    runs: int,
    after_each: Callable[[], None],
    sync_first: bool,
) -> dict[str, list[float]]:
    """Each round runs every write once, in a shuffled order, so the page cache's writeback
    hits every kind of write alike; ``after_each`` (untimed) joins background work. With
    ``sync_first`` the page cache is flushed (``os.sync``, untimed) before each write: every
    write then starts from a clean cache (slower on every row, see docs/capture.md)."""
    rng = random.Random(0)
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        names = list(fns)
        rng.shuffle(names)
        for name in names:
            if sync_first:
                os.sync()
            start = time.perf_counter()
            fns[name]()
            out[name].append(time.perf_counter() - start)
            after_each()
    return out


PAIRS = {
    "capture / torch.save of the same objects": (
        "capture (bundle), training thread blocked",
        "torch.save(model + optimizer + batch)",
    ),
    "capture + fsync / torch.save + fsync": (
        "capture (bundle) + background fsync joined",
        "torch.save(model + optimizer + batch) + fsync",
    ),
}


def paired_ratios(timings: dict[str, list[float]]) -> list[list[object]]:
    """Per round ``a / b`` of two interleaved writes, then median and quartiles."""
    rows: list[list[object]] = []
    for label, (a, b) in PAIRS.items():
        per_round = [x / y for x, y in zip(timings[a], timings[b], strict=True)]
        q1, q3 = quartiles(per_round)
        rows.append([label, median(per_round), q1, q3, "<= 1.5"])
    return rows


HEADERS = ["what", "runs", "median ms", "q1 ms", "q3 ms"]
RATIO_HEADERS = ["ratio (same round)", "median", "q1", "q3", "target"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=SIZES["width"])
    parser.add_argument("--layers", type=int, default=SIZES["layers"])
    parser.add_argument("--batch", type=int, default=SIZES["batch"])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--update-docs", type=Path, metavar="PAGE", help="e.g. docs/capture.md")
    parser.add_argument("--sync-first", action="store_true", help="os.sync() before each write")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 runs")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers, args.batch, args.runs = 32, 2, 8, 2
    return args


@dataclass
class BadStep:
    """A model, its optimizer (Adam moments present) and the evidence of one bad step."""

    model: Net
    optimizer: torch.optim.Optimizer
    batch: dict[str, Tensor]
    evidence: StepEvidence
    width: int
    layers: int

    def factory(self) -> tuple[nn.Module, Any]:
        """What replay rebuilds the model from."""
        return Net(self.width, self.layers), loss_fn


def bad_step(width: int, layers: int, batch_size: int) -> BadStep:
    """One step whose batch holds an all-zero sample, after one good step."""
    torch.manual_seed(0)
    model = Net(width, layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn(model, {"x": torch.randn(batch_size, width)}).backward()
    optimizer.step()  # Adam moments exist, as in a real run
    optimizer.zero_grad()
    batch = {"x": torch.randn(batch_size, width), "index": torch.arange(batch_size)}
    batch["x"][3] = 0.0
    rng = rng_state()
    loss = loss_fn(model, batch)
    loss.backward()
    stats = grad_stats(list(model.named_parameters()), torch.device("cpu"))
    agreement = Agreement([0], [0], [], [1], [float("nan")], float("nan"))
    evidence = step_evidence(0, Decision.SKIP, agreement, stats, [batch], rng, [loss.detach()])
    return BadStep(model, optimizer, batch, evidence, width, layers)


class Writes:
    """The writes compared, each to a new file or run folder under ``root``."""

    def __init__(self, step: BadStep, root: Path) -> None:
        self.step = step
        self.root = root
        self.pending: list[Capturer] = []
        self._counter = itertools.count()

    def by_name(self) -> dict[str, Callable[[], Any]]:
        return {
            "torch.save(model.state_dict())": self.plain_weights,
            "torch.save(model + optimizer + batch)": self.plain_all,
            "capture (bundle), training thread blocked": self.capture_blocking,
            "torch.save(model + optimizer + batch) + fsync": self.plain_all_fsync,
            "capture (bundle) + background fsync joined": self.capture_durable,
        }

    def plain_weights(self) -> None:
        torch.save(self.step.model.state_dict(), self.root / f"w-{next(self._counter)}.pt")

    def plain_all(self) -> None:
        torch.save(self._content(), self.root / f"all-{next(self._counter)}.pt")

    def plain_all_fsync(self) -> None:
        path = self.root / f"all-{next(self._counter)}.pt"
        with path.open("wb") as fh:
            torch.save(self._content(), fh)
            fh.flush()
            os.fsync(fh.fileno())

    def capture_blocking(self) -> None:
        """The time capture() blocks the caller; its background flush is joined untimed."""
        capturer = self._capturer()
        capturer.capture(self.step.model, self.step.optimizer, self.step.evidence)
        self.pending.append(capturer)

    def join_pending(self) -> None:
        while self.pending:
            syncing = self.pending.pop().syncing
            if syncing is not None:
                syncing.join()

    def capture_durable(self) -> Path | None:
        capturer = self._capturer()
        path = capturer.capture(self.step.model, self.step.optimizer, self.step.evidence)
        if capturer.syncing is not None:
            capturer.syncing.join()
        return path

    def _content(self) -> dict[str, Any]:
        step = self.step
        return {
            "model": step.model.state_dict(),
            "optim": step.optimizer.state_dict(),
            "batch": step.batch,
        }

    def _capturer(self) -> Capturer:
        run_dir = self.root / f"run-{next(self._counter)}"
        return Capturer(run_dir, Consensus(), EventLog(run_dir, 0))


def measure(writes: Writes, bundle: Path, args: argparse.Namespace) -> Timings:
    """Every write interleaved, then loading and replaying ``bundle``."""
    timings = interleaved(writes.by_name(), args.runs, writes.join_pending, args.sync_first)
    timings |= {
        "load_bundle (verify checksums)": _time(lambda: tg.load_bundle(bundle), args.runs),
        "replay (3 repeats + trace + bisection)": _time(
            lambda: tg.replay(bundle, writes.step.factory), max(2, args.runs // 2)
        ),
    }
    return timings


def timing_rows(timings: Timings) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, values in timings.items():
        q1, q3 = quartiles(values)
        rows.append([name, len(values), median(values) * 1e3, q1 * 1e3, q3 * 1e3])
    return rows


def headline(args: argparse.Namespace, n_params: int, size: int, report: dict[str, Any]) -> str:
    return (
        f"capture cost: MLP {args.layers} x {args.width} ({n_params / 1e6:.2f}M params, Adam), "
        f"batch {args.batch}; bundle {size / 1e6:.1f} MB; replay: {report['phase']} / "
        f"{report['op']} / {report['module']} / culprits {report['culprit_samples']}"
    )


def results_json(
    n_params: int, size: int, timings: Timings, ratios: list[list[object]], report: dict[str, Any]
) -> dict[str, Any]:
    return {
        "time": now_iso(),
        "machine": machine_info(),
        "params": n_params,
        "bundle_bytes": size,
        "timings_s": timings,
        "ratios": {r[0]: r[1] for r in ratios},
        "report": {k: report[k] for k in ("phase", "op", "module", "culprit_samples")},
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    step = bad_step(args.width, args.layers, args.batch)
    root = Path(tempfile.mkdtemp(prefix="tg-capture-bench-"))
    writes = Writes(step, root)
    bundle = writes.capture_durable()
    assert bundle is not None
    timings = measure(writes, bundle, args)
    report = tg.replay(bundle, step.factory).to_dict()
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    n_params = sum(p.numel() for p in step.model.parameters())
    table = markdown_table(HEADERS, timing_rows(timings))
    ratios = paired_ratios(timings)
    ratio_table = markdown_table(RATIO_HEADERS, ratios)
    print(headline(args, n_params, size, report))
    print(table)
    print()
    print(ratio_table)
    if args.update_docs is not None:
        replace_block(args.update_docs, "capture-cost", f"{table}\n\n{ratio_table}")
        print(f"updated {args.update_docs}", file=sys.stderr)
    if args.out is not None:
        write_json(args.out, results_json(n_params, size, timings, ratios, report))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
