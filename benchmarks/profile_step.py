"""Where the guard's host time goes: cProfile of guarded steps, and the cost of each piece.

    python benchmarks/profile_step.py [--device cuda] [--steps 2000] [--mode step|check]

A small model (the step is bound by host time, so every microsecond of the guard shows):
prints the median step time of bare training and of the guarded loop, the profile of the
guarded loop restricted to trainguard's functions, and the time of the pieces the guard
calls once per step (RNG snapshot, gradient pass, staging the flags to the host).
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

import trainguard as tg
from trainguard.capture.rng import rng_state
from trainguard.step.deferred import FoundInf, HostStager
from trainguard.step.detect import grad_stats, named_parameters


def _build(device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.GELU()]
    model = nn.Sequential(*layers).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Loop:
    def __init__(self, mode: str, device: str, run_dir: str) -> None:
        self.mode = mode
        self.model, self.opt = _build(device)
        data = itertools.cycle([torch.randn(8, 256, device=device) for _ in range(4)])
        self.guard = None if mode == "bare" else tg.Guard(self.model, self.opt, run_dir=run_dir)
        self.batches: Iterator[Tensor] = iter(self.guard.watch(data)) if self.guard else data

    def run(self, steps: int) -> None:
        for _ in range(steps):
            loss = self.model(next(self.batches)).pow(2).mean()
            loss.backward()
            if self.guard is not None and self.mode == "step":
                self.guard.step(loss)
                continue
            if self.guard is None or self.guard.check(loss):
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)


def _per_call_us(fn: Callable[[], Any], device: str, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return 1e6 * (time.perf_counter() - start) / n


def pieces(device: str) -> dict[str, float]:
    model, _ = _build(device)
    model(torch.randn(8, 256, device=device)).pow(2).mean().backward()
    params = named_parameters(model)
    dev = torch.device(device)
    buf = torch.zeros(3, dtype=torch.float64, device=device)
    stager, found_inf = HostStager(), FoundInf()
    return {
        "rng_state()": _per_call_us(rng_state, device),
        "grad_stats() (16 gradients)": _per_call_us(lambda: grad_stats(params, dev), device),
        "HostStager.stage(3 values)": _per_call_us(lambda: stager.stage(buf), device),
        "FoundInf.of(3 values)": _per_call_us(lambda: found_inf.of(buf, dev), device),
        "one tiny op (torch.isfinite)": _per_call_us(lambda: torch.isfinite(buf), device),
        **(
            {"torch.cuda.get_rng_state_all()": _per_call_us(torch.cuda.get_rng_state_all, device)}
            if device.startswith("cuda")
            else {}
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--mode", choices=("step", "check"), default="step")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        loops = {name: Loop(name, args.device, f"{tmp}/{name}") for name in ("bare", args.mode)}
        times: dict[str, list[float]] = {name: [] for name in loops}
        for _ in range(7):
            for name, loop in loops.items():
                _sync(args.device)
                start = time.perf_counter()
                loop.run(args.steps // 7)
                _sync(args.device)
                times[name].append(1e6 * (time.perf_counter() - start) / (args.steps // 7))
        for name, values in times.items():
            print(f"{name}: {statistics.median(values):.1f} us/step")
        profile = cProfile.Profile()
        profile.enable()
        loops[args.mode].run(args.steps)
        _sync(args.device)
        profile.disable()
        stats = pstats.Stats(profile).sort_stats("tottime")
        stats.print_stats(args.top)
        stats.sort_stats("cumtime").print_stats("trainguard", args.top)
    for name, us in pieces(args.device).items():
        print(f"{name}: {us:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
