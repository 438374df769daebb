"""CUDA checks for the sync-free step; needs a GPU (none on the CI or development machines).

    python benchmarks/gpu_check.py [--blocks 15] [--out runs/benchmarks/gpu_check.json]

1. ``torch.cuda.set_sync_debug_mode("error")`` around ``guard.step()`` with a fused AdamW on
   good steps and on a bad one (NaN loss): any host sync inside raises. The read of the step
   before happens just ahead of the checked region (it waits on a CUDA event recorded a step
   earlier; PyTorch does not count that wait as a synchronization, part 2 shows it).
2. Synchronizations per call, counted with ``set_sync_debug_mode("warn")``: ``guard.step()``
   (fused), ``guard.check()``, and the naive checks for comparison.
3. Throughput without a sync per step: blocks of steps timed from a synchronize to a
   synchronize, the modes interleaved block by block in shuffled order, medians and paired
   ratios; a small batch (the step is bound by kernel launches) and a large one.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, markdown_table, median, now_iso, quartiles, write_json

import trainguard as tg

WIDTH, DEPTH = 2048, 8


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers).cuda()


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# -- 1. no sync inside guard.step() -----------------------------------------------------------


def sync_free_check(steps: int, run_dir: str) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    guard = tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0)
    data = [torch.randn(64, WIDTH, device="cuda") for _ in range(steps)]
    bad = steps // 2
    errors: list[str] = []
    moved: list[bool] = []
    for i, batch in enumerate(guard.watch(data)):
        loss = model(batch).pow(2).mean()
        if i == bad:
            loss = loss * float("nan")
        loss.backward()
        guard._resolve_pending()  # the late read of the step before, outside the region
        before = _flat(model).clone()
        torch.cuda.set_sync_debug_mode("error")
        try:
            guard.step(loss)
        except RuntimeError as exc:
            errors.append(f"step {i}: {exc}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        moved.append(not torch.equal(before, _flat(model)))
    guard.close()
    step_counts = sorted({float(s["step"]) for s in opt.state.values()})
    return {
        "steps": steps,
        "bad_step": bad,
        "sync_errors": errors,
        "skipped": list(guard.state.nonfinite_steps),
        "weights_moved": moved,
        "optimizer_step_counts": step_counts,
        "ok": not errors
        and list(guard.state.nonfinite_steps) == [bad]
        and moved == [i != bad for i in range(steps)]
        and step_counts == [float(steps - 1)],
    }


# -- 2. syncs per call ------------------------------------------------------------------------


def _count_syncs(fn: Callable[[], object]) -> int:
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _grads(model: nn.Module) -> list[Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _nancapture(model: nn.Module) -> bool:
    return bool(torch.isfinite(torch.cat([g.flatten() for g in _grads(model)])).all().item())


def _per_param(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(g).all().item()) for g in _grads(model))


def _call(name: str, guard: tg.Guard, model: nn.Module, loss: Tensor) -> Callable[[], object]:
    """The call whose syncs are counted, for each way of checking a step."""
    calls: dict[str, Callable[[], object]] = {
        "guard.step (fused AdamW)": lambda: guard.step(loss),
        "guard.check": lambda: guard.check(loss),
        "nancapture": lambda: _nancapture(model),
        "per_param": lambda: _per_param(model),
    }
    return calls[name]


def sync_counts(steps: int, run_dir: str) -> dict[str, list[int]]:
    """Syncs in each call, step by step (the first step of the guard has no step before)."""
    out: dict[str, list[int]] = {}
    batch = torch.randn(64, WIDTH, device="cuda")
    for name in ("guard.step (fused AdamW)", "guard.check", "nancapture", "per_param"):
        model = _model()
        fused = name.startswith("guard.step")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
        guard = tg.Guard(model, opt, run_dir=f"{run_dir}/{len(out)}", hang_timeout=0)
        counts = []
        for _ in guard.watch([batch] * steps):
            loss = model(batch).pow(2).mean()
            loss.backward()
            counts.append(_count_syncs(_call(name, guard, model, loss)))
            if not fused:
                opt.step()
                opt.zero_grad()
        guard.close()
        out[name] = counts
    return out


# -- 3. throughput ----------------------------------------------------------------------------


class Mode:
    """One way of training the same model; ``step`` runs one training step."""

    def __init__(self, name: str, run_dir: str, batch: Tensor) -> None:
        self.name = name
        self.batch = batch
        self.model = _model()
        fused = name in ("bare_fused", "guard_step", "guard_check")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused)
        self.guard = (
            tg.Guard(self.model, self.opt, run_dir=run_dir, hang_timeout=0)
            if name.startswith("guard")
            else None
        )

    def step(self) -> None:
        loss = self.model(self.batch).pow(2).mean()
        loss.backward()
        if self.guard is not None and self.name == "guard_step":
            self.guard.step(loss)
            return
        ok = True
        if self.guard is not None:
            ok = self.guard.check(loss)
        elif self.name == "nancapture":
            self.saved = copy.deepcopy(self.batch)  # the callback keeps the batch for replay
            ok = _nancapture(self.model)
        if ok:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)


REFERENCES = {"guard_step": "bare_fused", "guard_check": "bare_fused", "nancapture": "bare"}
MODES = ("bare", "bare_fused", "guard_step", "guard_check", "nancapture")


def throughput(batch_size: int, blocks: int, block_steps: int, run_dir: str) -> dict[str, Any]:
    batch = torch.randn(batch_size, WIDTH, device="cuda")
    modes = {name: Mode(name, f"{run_dir}/{name}", batch) for name in MODES}
    times: dict[str, list[float]] = {name: [] for name in MODES}
    for b in range(-2, blocks):  # two warm-up blocks
        order = list(MODES)
        random.Random(b).shuffle(order)
        for name in order:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(block_steps):
                modes[name].step()
            torch.cuda.synchronize()
            if b >= 0:
                times[name].append(1e3 * (time.perf_counter() - start) / block_steps)
    for mode in modes.values():
        if mode.guard is not None:
            mode.guard.close()
    out: dict[str, Any] = {"batch": batch_size, "blocks": blocks, "block_steps": block_steps}
    for name in MODES:
        row: dict[str, Any] = {"step_ms": median(times[name]), "samples": times[name]}
        ref = REFERENCES.get(name)
        if ref is not None:
            ratios = [t / r for t, r in zip(times[name], times[ref], strict=True)]
            p25, p75 = quartiles(ratios)
            row.update(reference=ref, ratio=median(ratios), ratio_p25=p25, ratio_p75=p75)
        out[name] = row
    return out


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for res in results:
        for name in MODES:
            row = res[name]
            rows.append(
                [
                    res["batch"],
                    name,
                    row["step_ms"],
                    row.get("reference", ""),
                    row.get("ratio"),
                    row.get("ratio_p25"),
                    row.get("ratio_p75"),
                ]
            )
    headers = ("batch", "mode", "step ms", "vs", "ratio", "ratio p25", "ratio p75")
    return markdown_table(headers, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps of the sync checks")
    parser.add_argument("--blocks", type=int, default=15, help="timed blocks per mode")
    parser.add_argument("--block-steps", type=int, default=20, help="steps per block")
    parser.add_argument("--batches", default="64,8192", help="batch sizes for the timing")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks/gpu_check.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a machine with a GPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        sync_free = sync_free_check(args.steps, tmp + "/a")
        counts = sync_counts(args.steps // 2, tmp + "/b")
        timing = [
            throughput(int(b), args.blocks, args.block_steps, f"{tmp}/t{b}")
            for b in args.batches.split(",")
        ]
    report: dict[str, Any] = {
        "benchmark": "gpu_check",
        "date": now_iso(),
        "command": " ".join(["python", *sys.argv]),
        "machine": machine_info(),
        "model": f"{DEPTH} x (Linear({WIDTH}, {WIDTH}) + GELU), AdamW",
        "sync_free": sync_free,
        "sync_counts": counts,
        "throughput": timing,
    }
    write_json(args.out, report)
    print(f"sync-free guard.step(): {'ok' if sync_free['ok'] else 'FAILED'} {sync_free}")
    print("\nsyncs per call, step by step:")
    for name, c in counts.items():
        print(f"  {name}: {c}")
    print(f"\n{report['model']}, {report['machine']['gpu']}, torch {torch.__version__}")
    print(table(timing))
    print(f"\nJSON: {args.out}", file=sys.stderr)
    return 0 if sync_free["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
