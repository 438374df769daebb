"""What a capture costs on a bad step, and how long a replay takes.

A small MLP (``--width`` x ``--layers``, Adam) hits one bad step (an all-zero sample whose
row norm is 0 in ``blocks.0.norm``). Timed, each ``--runs`` times, in one process:

- ``torch.save(model.state_dict())``: the floor: plain weights, one file;
- ``torch.save(model + optimizer + batch)``: the same content as a bundle, one file, no
  fsync, no checksum;
- ``capture``: trainguard's bundle (5 files a rank, hashed while written, fsynced, manifest,
  atomic rename);
- ``load_bundle`` (every checksum verified);
- ``replay``: 3 repeats, the traced run and the bisection.

    python benchmarks/capture_cost.py                # default sizes
    python benchmarks/capture_cost.py --quick        # tiny sizes (smoke test)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine_info, markdown_table, median, now_iso, quartiles, write_json

import trainguard as tg
from trainguard.capture import Capturer, step_evidence
from trainguard.consensus import Agreement, Consensus
from trainguard.detect import grad_stats
from trainguard.events import EventLog
from trainguard.policy import Decision
from trainguard.rng import rng_state

SIZES = {"width": 512, "layers": 4, "batch": 64}


class RowNorm(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x / x.norm(dim=-1, keepdim=True)


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
    return model(batch["x"]).pow(2).mean()


def _time(fn: Callable[[], Any], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=SIZES["width"])
    parser.add_argument("--layers", type=int, default=SIZES["layers"])
    parser.add_argument("--batch", type=int, default=SIZES["batch"])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 runs")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers, args.batch, args.runs = 32, 2, 8, 2
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width, layers = args.width, args.layers
    model = Net(width, layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn(model, {"x": torch.randn(args.batch, width)}).backward()
    optimizer.step()  # Adam moments exist, as in a real run
    optimizer.zero_grad()
    batch = {"x": torch.randn(args.batch, width), "index": torch.arange(args.batch)}
    batch["x"][3] = 0.0
    rng = rng_state()
    loss = loss_fn(model, batch)
    loss.backward()
    params = list(model.named_parameters())
    stats = grad_stats(params, torch.device("cpu"))
    agreement = Agreement([0], [0], [], [1], [float("nan")], float("nan"))
    evidence = step_evidence(0, Decision.SKIP, agreement, stats, [batch], rng, [loss.detach()])

    root = Path(tempfile.mkdtemp(prefix="tg-capture-bench-"))
    counter = iter(range(10**6))

    def plain_weights() -> None:
        torch.save(model.state_dict(), root / f"w-{next(counter)}.pt")

    def plain_all() -> None:
        content = {"model": model.state_dict(), "optim": optimizer.state_dict(), "batch": batch}
        torch.save(content, root / f"all-{next(counter)}.pt")

    def capture() -> Path | None:
        run_dir = root / f"run-{next(counter)}"
        capturer = Capturer(run_dir, Consensus(), EventLog(run_dir, 0))
        return capturer.capture(model, optimizer, evidence)

    bundle = capture()
    assert bundle is not None

    def factory() -> tuple[nn.Module, Any]:
        return Net(width, layers), loss_fn

    timings = {
        "torch.save(model.state_dict())": _time(plain_weights, args.runs),
        "torch.save(model + optimizer + batch)": _time(plain_all, args.runs),
        "capture (bundle)": _time(capture, args.runs),
        "load_bundle (verify checksums)": _time(lambda: tg.load_bundle(bundle), args.runs),
        "replay (3 repeats + trace + bisection)": _time(
            lambda: tg.replay(bundle, factory), max(2, args.runs // 2)
        ),
    }
    report = tg.replay(bundle, factory).to_dict()
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    n_params = sum(p.numel() for p in model.parameters())
    rows = []
    for name, values in timings.items():
        q1, q3 = quartiles(values)
        rows.append([name, len(values), median(values) * 1e3, q1 * 1e3, q3 * 1e3])
    print(
        f"capture cost: MLP {layers} x {width} ({n_params / 1e6:.2f}M params, Adam), batch "
        f"{args.batch}; bundle {size / 1e6:.1f} MB; replay: {report['phase']} / "
        f"{report['op']} / {report['module']} / culprits {report['culprit_samples']}"
    )
    print(markdown_table(["what", "runs", "median ms", "q1 ms", "q3 ms"], rows))
    if args.out is not None:
        write_json(
            args.out,
            {
                "time": now_iso(),
                "machine": machine_info(),
                "params": n_params,
                "bundle_bytes": size,
                "timings_s": timings,
                "report": {k: report[k] for k in ("phase", "op", "module", "culprit_samples")},
            },
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
