"""What does a capture cost on the bad step, and how long do loading and replaying it take?

A small MLP (``--width`` x ``--layers``, Adam) meets one bad step: its batch holds an
all-zero sample, whose row norm is 0 in the first block, so the loss is NaN. The guarded
loop (``tg.Guard(capture=True)``, ``watch()`` + ``check()``) writes the replay bundle of that
step inside the bad step's ``check()``. Compared in interleaved rounds (every write once a
round, in a shuffled order), each to a new file or run folder:

- ``torch.save(model.state_dict())``: the floor, plain weights in one file;
- ``torch.save(model + optimizer + batch)``: what the naive capture writes (one file, no
  checksum, no fsync), and the same ``+ fsync``;
- ``capture``: the bad step's ``guard.check(loss)``: the time the training thread is blocked
  (the bundle's files, checksums, manifest, atomic rename; the flush to disk runs in a
  background thread after that, joined outside the timing);
- ``capture + fsync``: the same, with the background flush joined: durable on disk;
- ``good check()``: a good step's ``check()`` of the same guards, for scale.

Then ``tg.load_bundle`` (every checksum verified) and ``tg.replay`` (3 repeats, the traced
run, the bisection for the culprit sample), ``--runs`` times each.

    python benchmarks/capture_cost.py                 # default sizes, 10 rounds
    python benchmarks/capture_cost.py --device cuda   # the model and optimizer on the GPU
    python benchmarks/capture_cost.py --quick         # tiny sizes: a smoke run
"""

from __future__ import annotations

import copy
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

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
    quartiles,
    synchronize,
)

import trainguard as tg

NAME = "capture_cost"
SIZES = {"width": 512, "layers": 4, "batch": 64}
PAIRS = {
    "capture / torch.save of the same objects": ("capture", "torch.save(model+optimizer+batch)"),
    "capture + fsync / torch.save + fsync": (
        "capture + fsync",
        "torch.save(model+optimizer+batch) + fsync",
    ),
}

Batch = dict[str, Tensor]


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


def loss_fn(model: nn.Module, batch: Batch) -> Tensor:
    loss: Tensor = model(batch["x"]).pow(2).mean()
    return loss


class Bench:
    """The trained model and its optimizer (Adam moments present), a good and a bad batch,
    and the writes compared, each to a new file or run folder under ``root``."""

    def __init__(self, width: int, layers: int, batch: int, device: str, root: Path) -> None:
        self.width, self.layers, self.device, self.root = width, layers, device, root
        torch.manual_seed(0)
        self.model = Net(width, layers).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        loss_fn(self.model, {"x": torch.randn(batch, width, generator=gen).to(device)}).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.good = {"x": torch.randn(batch, width, generator=gen), "index": torch.arange(batch)}
        self.bad = {"x": torch.randn(batch, width, generator=gen), "index": torch.arange(batch)}
        self.bad["x"][3] = 0.0  # row norm 0: NaN in the first block
        self.good = {k: v.to(device) for k, v in self.good.items()}
        self.bad = {k: v.to(device) for k, v in self.bad.items()}
        self.counter = itertools.count()
        self.good_checks: list[float] = []
        self.bundle: Path | None = None

    def factory(self) -> tuple[nn.Module, Any]:
        """What replay rebuilds the model from."""
        return Net(self.width, self.layers), loss_fn

    def writes(self) -> dict[str, Callable[[], float]]:
        return {
            "torch.save(model.state_dict())": self.plain_weights,
            "torch.save(model+optimizer+batch)": lambda: self.plain_all(fsync=False),
            "torch.save(model+optimizer+batch) + fsync": lambda: self.plain_all(fsync=True),
            "capture": lambda: self.capture(durable=False),
            "capture + fsync": lambda: self.capture(durable=True),
        }

    def plain_weights(self) -> float:
        start = time.perf_counter()
        torch.save(self.model.state_dict(), self.root / f"w-{next(self.counter)}.pt")
        return time.perf_counter() - start

    def plain_all(self, fsync: bool) -> float:
        path = self.root / f"all-{next(self.counter)}.pt"
        start = time.perf_counter()
        content = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "batch": self.bad,
        }
        with path.open("wb") as fh:
            torch.save(content, fh)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        return time.perf_counter() - start

    def capture(self, durable: bool) -> float:
        """A fresh guarded copy of the model takes one good step, then the bad one: the bad
        step's ``check()`` is timed (and, when ``durable``, the bundle's flush joined)."""
        model = copy.deepcopy(self.model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        optimizer.load_state_dict(self.optimizer.state_dict())
        run_dir = self.root / f"run-{next(self.counter)}"
        guard = tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=0)
        elapsed = 0.0
        for index, batch in enumerate(guard.watch([self.good, self.bad])):
            loss = loss_fn(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            synchronize(self.device)
            start = time.perf_counter()
            ok = guard.check(loss)
            if index == 1 and durable:
                _join_bundle_flush()
            elapsed = time.perf_counter() - start
            if index == 0:
                self.good_checks.append(elapsed)
            assert ok == (index == 0), "the bad step must be the second"
            if ok:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _join_bundle_flush()  # untimed: runs do not overlap
        guard.close()
        bundles = sorted((run_dir / "captures").glob("step-*"))
        assert len(bundles) == 1, f"expected one bundle in {run_dir}"
        self.bundle = bundles[0]
        return elapsed


def _join_bundle_flush() -> None:
    """Wait for the background flush of the bundle just written (its thread's name is
    ``trainguard-bundle-sync``)."""
    for thread in threading.enumerate():
        if thread.name.startswith("trainguard-bundle-sync"):
            thread.join()


def _time(fn: Callable[[], Any], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, rounds=10, quick_rounds=2, warmup=1)
    p.add_argument("--width", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--runs", type=int, help="load_bundle and replay runs (default: rounds)")
    args = p.parse_args(argv)
    finish_args(p, args, NAME)
    quick = {"width": 32, "layers": 2, "batch": 8}
    sizes = {k: getattr(args, k) or (quick if args.quick else SIZES)[k] for k in SIZES}
    runs = args.runs or args.rounds
    torch.set_num_threads(1)
    report = header(
        NAME, argv, {**sizes, "rounds": args.rounds, "runs": runs, "device": args.device}
    )
    root = Path(tempfile.mkdtemp(prefix="tg-capture-cost-"))
    try:
        bench = Bench(sizes["width"], sizes["layers"], sizes["batch"], args.device, root)
        writes = bench.writes()
        seconds = interleave(list(writes), lambda name: writes[name](), args.rounds, args.warmup)
        bundle = bench.bundle
        assert bundle is not None
        seconds["good check()"] = bench.good_checks[-args.rounds :]
        seconds["tg.load_bundle (verify checksums)"] = _time(lambda: tg.load_bundle(bundle), runs)
        replay_runs = max(1, runs // 2)
        replays = _time(lambda: tg.replay(bundle, bench.factory, device=args.device), replay_runs)
        seconds["tg.replay (3 repeats + trace + bisection)"] = replays
        found = tg.replay(bundle, bench.factory, device=args.device).to_dict()
        size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
        params = sum(t.numel() for t in bench.model.parameters())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    timings = {name: [round(s * 1e3, 4) for s in values] for name, values in seconds.items()}
    rows = []
    for name, ms in timings.items():
        q1, q3 = quartiles(ms)
        rows.append([name, len(ms), median(ms), q1, q3])
    ratios = {label: paired(timings[a], timings[b]) for label, (a, b) in PAIRS.items()}
    print(
        f"MLP {sizes['layers']} x {sizes['width']} ({params / 1e6:.2f}M parameters, Adam), batch "
        f"{sizes['batch']}, {args.device}; bundle {size / 1e6:.2f} MB; replay found "
        f"{found['phase']} / {found['op']} / {found['module']} / samples {found['culprit_samples']}"
    )
    print(markdown_table(["what", "runs", "median ms", "q1 ms", "q3 ms"], rows))
    ratio_rows = [
        [label, r["ratio"], interval(r["ratio_ci95"]), r["ratio_p25"], r["ratio_p75"]]
        for label, r in ratios.items()
    ]
    print()
    print(markdown_table(["ratio (same round)", "median", "95% CI", "p25", "p75"], ratio_rows))
    report.update(
        parameters=params,
        bundle_bytes=size,
        timings_ms=timings,
        median_ms={name: median(ms) for name, ms in timings.items()},
        ratios=ratios,
        replay={k: found[k] for k in ("phase", "op", "module", "culprit_samples")},
    )
    finish(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
