"""The tiny model and the training loop of each mode of ``fixed_cost.py`` (see there)."""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import trainguard as tg
from trainguard.capture.rng import RngSnapshot

EVERY_LINE = "metrics_lines_per_second" in tg.GuardConfig.__dataclass_fields__
"""Whether the trainguard imported has the option (``fixed_cost_ab.py`` runs older trees)."""
MODES = ("bare", "naive_loss", "naive_norm", "minimal", "guard_check", "guard_step") + (
    ("guard_every_line",) if EVERY_LINE else ()
)
GUARDED = ("guard_check", "guard_step", "guard_every_line")

DIST_MODES = ("bare", "guard_check")
BATCH, DIM_IN, HIDDEN = 32, 16, 32

Batch = tuple[Tensor, Tensor]


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))


def make_batches(seed: int, count: int = 64) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, DIM_IN, generator=gen), torch.randn(BATCH, 1, generator=gen))
        for _ in range(count)
    ]


class Loop:
    """One mode's training loop; ``run(n)`` takes ``n`` steps."""

    def __init__(self, mode: str, seed: int, run_dir: Path, ddp: bool = False) -> None:
        self.mode = mode
        model = build_model(seed)
        self.model: nn.Module = nn.parallel.DistributedDataParallel(model) if ddp else model
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        data = itertools.cycle(make_batches(seed + 1))
        self.guard: tg.Guard | None = None
        self.batches: Iterator[Batch] = data
        if mode in GUARDED:
            config = tg.GuardConfig(run_dir=run_dir / mode)
            if mode == "guard_every_line":
                config.metrics_lines_per_second = math.inf  # every line, as before round 8
            self.guard = tg.Guard(self.model, self.opt, config=config)
            self.batches = iter(self.guard.watch(data))
        self.loss_fn = nn.MSELoss()
        self._ring: collections.deque[tuple[int, float, float, bool]] = collections.deque(
            maxlen=1000
        )
        self._step, self._started = 0, -1
        self._snapshot: RngSnapshot | None = None
        if mode == "minimal":
            self.model.register_forward_pre_hook(self._minimal_start)

    def _minimal_start(self, module: nn.Module, args: Any) -> None:
        if self._started != self._step and torch.is_grad_enabled():
            self._started, self._snapshot = self._step, RngSnapshot.take()

    def run(self, steps: int) -> None:
        run = getattr(self, f"_run_{self.mode}")
        run(steps)

    def _loss(self, batch: Batch) -> Tensor:
        x, y = batch
        loss: Tensor = self.loss_fn(self.model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        return loss

    def _update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _run_bare(self, steps: int) -> None:
        batches = self.batches
        for _ in range(steps):
            self._loss(next(batches))
            self._update()

    def _run_naive_loss(self, steps: int) -> None:
        batches = self.batches
        for _ in range(steps):
            loss = self._loss(next(batches))
            if torch.isfinite(loss).item():
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def _run_naive_norm(self, steps: int) -> None:
        batches, params = self.batches, list(self.model.parameters())
        for _ in range(steps):
            loss = self._loss(next(batches))
            norm = nn.utils.clip_grad_norm_(params, max_norm=float("inf"))
            if torch.isfinite(torch.stack([loss.detach(), norm])).all().item():
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def _run_minimal(self, steps: int) -> None:
        batches, params, ring = self.batches, list(self.model.parameters()), self._ring
        for _ in range(steps):
            batch = next(batches)
            loss = self._loss(batch)
            norms = torch._foreach_norm([p.grad for p in params if p.grad is not None])
            ends = [end for tensor in batch for end in torch.aminmax(tensor)]
            row = torch.stack([loss.detach(), *norms, *ends]).tolist()
            ok = all(map(math.isfinite, row))
            norm = math.sqrt(sum(v * v for v in row[1 : 1 + len(norms)]))
            ring.append((self._step, row[0], norm, ok))
            self._step += 1
            if ok:
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def _run_guard_check(self, steps: int) -> None:
        guard, batches = self.guard, self.batches
        assert guard is not None
        for _ in range(steps):
            loss = self._loss(next(batches))
            if guard.check(loss):
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def _run_guard_every_line(self, steps: int) -> None:
        self._run_guard_check(steps)  # the guard's metrics log keeps every step

    def _run_guard_step(self, steps: int) -> None:
        guard, batches = self.guard, self.batches
        assert guard is not None
        for _ in range(steps):
            guard.step(self._loss(next(batches)))

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
