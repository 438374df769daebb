"""What the guard's input check costs, measured against the forward pass it protects.

The check the guard runs at each step (``trainguard.step.inputs``): collect the batch's
floating-point tensors, then ``max |x|`` over them in one fused ``torch._foreach_norm(inf)``
per device, a float64 scalar left on the device (here read back, to time it to the end).
Timed against, on the same batch, interleaved in random order each round:

- ``forward``: the training forward of a matching model (autograd on, output discarded);
- ``naive``: ``bool(torch.isfinite(t).all())`` per floating-point tensor (a host sync each);
- ``foreach_f64``: ``torch._foreach_norm(inf, dtype=float64)`` over the tensors: the
  accelerator path of the check, and what the CPU path ran before it moved to ``aminmax``.

Workloads (``WORKLOADS``): token ids (int64: nothing to check, the cost is the batch walk),
an image batch 64x3x224x224 with a small conv net, a CIFAR-sized 256x3x32x32 batch with a
small conv net, and float features 1024x256 with an MLP. Medians over rounds; ratio = check
/ forward.

    python benchmarks/input_check_cost.py                  # default sizes, 30 rounds
    python benchmarks/input_check_cost.py --quick          # tiny sizes (smoke test)
    python benchmarks/input_check_cost.py --docs docs/spikes.md   # also rewrite the table
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).parent))
from _common import (
    load_average,
    machine_info,
    markdown_table,
    median,
    now_iso,
    quartiles,
    replace_block,
    write_json,
)

from trainguard.step.inputs import float_tensors, max_abs

METHODS = ("check", "foreach_f64", "naive", "forward")


class TinyLM(nn.Module):
    """Embedding + ``layers`` transformer encoder layers + a vocabulary head."""

    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True, dropout=0.0)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        out: Tensor = self.head(self.blocks(self.embed(batch["input_ids"])))
        return out


class ConvNet(nn.Module):
    """``stages`` x (3x3 conv, stride 2, ReLU), global average pool, linear head."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        convs: list[nn.Module] = []
        for c_in, c_out in zip((3, *widths[:-1]), widths, strict=True):
            convs += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1), nn.ReLU()]
        self.features = nn.Sequential(*convs, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(widths[-1], 10)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        out: Tensor = self.head(self.features(batch["pixel_values"]))
        return out


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.head = nn.Linear(hidden, 10)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        out: Tensor = self.head(self.net(batch["features"]))
        return out


@dataclass
class Workload:
    name: str
    describe: str
    batch: Callable[[bool], dict[str, Tensor]]
    model: Callable[[bool], nn.Module]


def _tokens(quick: bool) -> dict[str, Tensor]:
    shape = (2, 32) if quick else (8, 512)
    return {
        "input_ids": torch.randint(0, 1000, shape),
        "attention_mask": torch.ones(shape, dtype=torch.int64),
    }


def _image(size: int, batch: int) -> Callable[[bool], dict[str, Tensor]]:
    def make(quick: bool) -> dict[str, Tensor]:
        shape = (2, 3, 32, 32) if quick else (batch, 3, size, size)
        return {"pixel_values": torch.randn(shape), "labels": torch.randint(0, 10, shape[:1])}

    return make


def _features(quick: bool) -> dict[str, Tensor]:
    rows = 16 if quick else 1024
    return {"features": torch.randn(rows, 256), "labels": torch.randint(0, 10, (rows,))}


WORKLOADS = (
    Workload(
        "tokens", "int64 ids 8x512 + mask, TinyLM dim 256, 2 layers", _tokens,
        lambda quick: TinyLM(1000, 64 if quick else 256, 2),
    ),
    Workload(
        "image224", "float 64x3x224x224, ConvNet 32-64-128-256", _image(224, 64),
        lambda quick: ConvNet((8, 16) if quick else (32, 64, 128, 256)),
    ),
    Workload(
        "image32", "float 256x3x32x32, ConvNet 32-64-128", _image(32, 256),
        lambda quick: ConvNet((8, 16) if quick else (32, 64, 128)),
    ),
    Workload(
        "features", "float 1024x256, MLP 256-1024-1024-10", _features,
        lambda quick: MLP(256, 64 if quick else 1024),
    ),
)  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _methods(
    model: nn.Module, batch: dict[str, Tensor], device: torch.device
) -> dict[str, Callable[[], object]]:
    def check() -> object:  # what the guard runs, read back so the timing covers it
        return float(max_abs(float_tensors([batch]), device))

    def foreach_f64() -> object:  # the guard's CPU check before aminmax (the CUDA path's op)
        tensors = float_tensors([batch])
        if not tensors:
            return 0.0
        norms = torch._foreach_norm(tensors, float("inf"), dtype=torch.float64)
        return float(torch.stack(list(norms)).amax())

    def naive() -> object:
        return all(bool(torch.isfinite(t).all()) for t in float_tensors([batch]))

    def forward() -> object:
        return model(batch)

    return {"check": check, "foreach_f64": foreach_f64, "naive": naive, "forward": forward}


def _time(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    setups = {}
    for workload in WORKLOADS:
        model = workload.model(args.quick).to(device).train()
        batch = {k: v.to(device) for k, v in workload.batch(args.quick).items()}
        setups[workload.name] = _methods(model, batch, device)
    times: dict[str, dict[str, list[float]]] = {w: {m: [] for m in METHODS} for w in setups}
    for round_ in range(args.warmup + args.rounds):
        jobs = [(w, m) for w in setups for m in METHODS]
        rng.shuffle(jobs)  # interleaved: load drifts hit every method alike
        for name, method in jobs:
            seconds = _time(setups[name][method], device)
            if round_ >= args.warmup:
                times[name][method].append(seconds * 1e3)
    return times


def summarize(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for workload in WORKLOADS:
        per = times[workload.name]
        medians = {m: median(v) for m, v in per.items()}
        stats = {m: {"median_ms": medians[m], "iqr_ms": quartiles(v)} for m, v in per.items()}
        out[workload.name] = {
            "batch_and_model": workload.describe,
            **stats,
            "check_over_forward": medians["check"] / medians["forward"],
            "naive_over_forward": medians["naive"] / medians["forward"],
            "foreach_f64_over_forward": medians["foreach_f64"] / medians["forward"],
            "samples_ms": per,
        }
    return out


def table(summary: dict[str, Any]) -> str:
    headers = [
        "workload",
        "batch, model",
        "check ms",
        "foreach_f64 ms",
        "naive ms",
        "forward ms",
        "check / forward",
        "naive / forward",
    ]
    rows = [
        [
            name,
            s["batch_and_model"],
            s["check"]["median_ms"],
            s["foreach_f64"]["median_ms"],
            s["naive"]["median_ms"],
            s["forward"]["median_ms"],
            f"{100 * s['check_over_forward']:.2f}%",
            f"{100 * s['naive_over_forward']:.2f}%",
        ]
        for name, s in summary.items()
    ]
    return markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--label", default="", help="e.g. 'shared machine'")
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    parser.add_argument("--docs", type=Path, default=None, help="page to rewrite the table in")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    load_before = load_average()
    summary = summarize(measure(args, device))
    text = table(summary)
    print(text)
    machine = machine_info()
    note = (
        f"{args.rounds} rounds (+{args.warmup} warm-up), medians, device {device}, "
        f"{args.threads} CPU thread(s), load average {load_before} -> {machine['load_average']}"
        + (f", {args.label}" if args.label else "")
    )
    print(f"\n{note}")
    out = args.out or Path(__file__).parent / "results" / device.type / "input_check_cost.json"
    write_json(
        out,
        {
            "benchmark": "input_check_cost",
            "time": now_iso(),
            "label": args.label,
            "quick": args.quick,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "device": str(device),
            "machine": machine,
            "load_average_before": load_before,
            "workloads": summary,
        },
    )
    if args.docs is not None:
        replace_block(args.docs, "input-check-cost", f"{text}\n\n{note}.")


if __name__ == "__main__":
    main()
