"""What the overhead benchmark trains, and how each mode takes one training step.

Two workloads (``Workload``: an MLP stack and a small GPT-style transformer, at the sizes of
``SIZES``) and the modes compared on them (``MODES``): bare training, the naive checks, and
trainguard. A mode is a ``Runner`` over a ``ModeContext`` (its own model, optimizer and
batches); ``Runner.step`` times one step, phase by phase (``PHASES``).
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import median
from _gpt import TinyGPT
from torch import Tensor, nn

import trainguard as tg
from trainguard.step.held_work import HeldWork

Batch = tuple[Tensor, Tensor]
Sample = dict[str, float]
"""One timed step: milliseconds per phase plus ``total``."""

PHASES = ("fetch", "pre", "fwd_bwd", "check", "optim")


# -- workloads --------------------------------------------------------------------------------


class MLPStack(nn.Module):
    """``layers`` x (Linear(width, width) + ReLU): parameter-heavy, little compute per weight."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
        )

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.layers(x)
        return out


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    sizes: dict[str, int]
    lr: float
    clip_norm: float
    """Default ``max_norm`` for the clip modes: below the typical gradient norm, so it clips."""

    def build(self) -> nn.Module:
        s = self.sizes
        if self.name == "mlp":
            return MLPStack(s["width"], s["layers"])
        return TinyGPT(s["vocab"], s["dim"], s["layers"], s["heads"], s["seq"])

    def batch(self, gen: torch.Generator) -> Batch:
        s = self.sizes
        if self.name == "mlp":
            shape = (s["batch"], s["width"])
            return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        inputs, targets = batch
        out = model(inputs)
        if self.name == "mlp":
            return F.mse_loss(out, targets)
        return F.cross_entropy(out.flatten(0, 1), targets.flatten())


SIZES: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "quick": (
        {"width": 64, "layers": 3, "batch": 4},
        {"vocab": 64, "dim": 32, "layers": 1, "heads": 2, "seq": 16, "batch": 2},
    ),
    "cpu": (
        {"width": 1448, "layers": 12, "batch": 16},
        {"vocab": 4096, "dim": 256, "layers": 4, "heads": 4, "seq": 128, "batch": 8},
    ),
    # A step of tens of milliseconds on a data-centre GPU; the cpu sizes take 1-3 ms there,
    # where kernel launches rather than the work set the step time.
    "gpu": (
        {"width": 4096, "layers": 8, "batch": 512},
        {"vocab": 32768, "dim": 1024, "layers": 8, "heads": 16, "seq": 512, "batch": 16},
    ),
}
"""``--sizes``: (MLP sizes, transformer sizes)."""


def workloads(sizes: str) -> dict[str, Workload]:
    mlp, gpt = SIZES[sizes]
    return {
        "mlp": Workload(
            "mlp",
            "MLP stack {layers} x Linear({width}, {width}) + ReLU, batch {batch}, MSE, AdamW",
            mlp,
            lr=1e-4,
            clip_norm=0.005,
        ),
        "transformer": Workload(
            "transformer",
            "GPT-style: vocab {vocab}, dim {dim}, {layers} layers, {heads} heads, "
            "seq {seq}, batch {batch}, cross-entropy, AdamW",
            gpt,
            lr=3e-4,
            clip_norm=0.25,
        ),
    }


# -- modes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModeSpec:
    description: str
    reference: str | None = "bare"
    slow: bool = False
    fused: bool = False
    """The mode's AdamW runs the fused kernels (``fused=True``)."""
    cuda_only_default: bool = False
    """In the default set on CUDA only (on CPU: ask for it with ``--modes``)."""


MODES: dict[str, ModeSpec] = {
    "bare": ModeSpec("bare training (forward, backward, optimizer step, zero_grad)", None),
    "foreach_norm": ModeSpec("bare + one torch._foreach_norm pass over the gradients"),
    "norm_allreduce": ModeSpec(
        "foreach_norm + the total norm in one small all-reduce, read on the host: the floor "
        "for a check whose decision every rank shares (no all-reduce in one process)"
    ),
    "guard": ModeSpec(
        "trainguard defaults: Guard(capture=True), watch() + check(loss) as in the README"
    ),
    "guard_lean": ModeSpec(
        "trainguard defaults without the spike rule and the input check "
        "(on_spike='off', check_inputs=False): their cost is guard / guard_lean"
    ),
    "bare_clip": ModeSpec("bare + torch.nn.utils.clip_grad_norm_(max_norm)"),
    "guard_clip": ModeSpec("trainguard defaults with grad_clip=max_norm", "bare_clip"),
    "nancapture": ModeSpec(
        "NaNCapture-style: deepcopy(batch) + RNG snapshot, torch.cat(grads), "
        "isfinite().all().item()"
    ),
    "per_param": ModeSpec("per-parameter loop: isfinite(p.grad).all().item()"),
    "detect_anomaly": ModeSpec(
        "forward + backward under torch.autograd.detect_anomaly()", slow=True
    ),
    "bare_fused": ModeSpec(
        "bare training with AdamW(fused=True)", fused=True, cuda_only_default=True
    ),
    "guard_step": ModeSpec(
        "trainguard defaults, guard.step(loss) with AdamW(fused=True): the sync-free step",
        "bare_fused",
        fused=True,
        cuda_only_default=True,
    ),
}


@dataclass
class ModeContext:
    """What one mode owns: its model (DDP-wrapped when distributed), optimizer and batches."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: Iterator[Batch]
    loss_fn: Callable[[nn.Module, Batch], Tensor]
    max_norm: float
    run_dir: Path
    clock: Callable[[], float] = time.perf_counter
    """Step start and end; on CUDA it synchronizes first, so the step includes its kernels."""
    phase_clock: Callable[[], float] = time.perf_counter
    """Phase boundaries inside the step: never synchronizes (on CUDA: host time per phase)."""

    def grads(self) -> list[Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]


class Runner:
    """One mode's training step; subclasses add work before forward and after backward."""

    anomaly = False
    owns_step = False
    """``after()`` runs the optimizer step and ``zero_grad`` itself."""

    def __init__(self, ctx: ModeContext) -> None:
        self.ctx = ctx
        self.skipped = 0

    def fetch(self) -> Batch:
        return next(self.ctx.batches)

    def before(self, batch: Batch) -> None:
        """Work at the start of the step, before forward (a callback's ``on_batch_start``)."""

    def after(self, loss: Tensor) -> bool:
        """Work between backward and the optimizer step; False skips the step."""
        return True

    def step(self) -> Sample:
        ctx = self.ctx
        clock = ctx.phase_clock
        t0 = ctx.clock()
        batch = self.fetch()
        t1 = clock()
        self.before(batch)
        t2 = clock()
        with torch.autograd.detect_anomaly() if self.anomaly else contextlib.nullcontext():
            loss = ctx.loss_fn(ctx.model, batch)
            loss.backward()
        t3 = clock()
        ok = self.after(loss)
        t4 = clock()
        if not self.owns_step:
            if ok:
                ctx.optimizer.step()
            else:
                self.skipped += 1
            ctx.optimizer.zero_grad()
        t5 = ctx.clock()
        times = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
        sample = {phase: 1e3 * dt for phase, dt in zip(PHASES, times, strict=True)}
        sample["total"] = 1e3 * (t5 - t0)
        return sample

    def close(self) -> dict[str, Any]:
        """Release what the mode holds; returns notes for the report."""
        return {"skipped_steps": self.skipped}


class ForeachNormRunner(Runner):
    def after(self, loss: Tensor) -> bool:
        torch._foreach_norm(self.ctx.grads(), 2.0)
        return True


class NormAllReduceRunner(Runner):
    """The least a check that every rank agrees on can do: one norm pass, one all-reduce of a
    row as small as the guard's, one host read. Its works are released on the main thread
    (``HeldWork``, as the guard's: a Python tensor's work dropped last by gloo's thread at
    interpreter exit aborts the process, issue 15)."""

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self.held = HeldWork()

    def after(self, loss: Tensor) -> bool:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(self.ctx.grads(), 2.0)))
        row = torch.stack([loss.detach(), loss.detach(), norm]).to(torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            row = torch.cat([row, row.new_zeros(2)]).repeat(dist.get_world_size())
            self.held.wait(dist.all_reduce(row, async_op=True))
        return bool(torch.isfinite(row).all())

    def close(self) -> dict[str, Any]:
        self.held.retire()
        return super().close()


class ClipRunner(Runner):
    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self.norms: list[Tensor] = []

    def after(self, loss: Tensor) -> bool:
        norm = torch.nn.utils.clip_grad_norm_(self.ctx.model.parameters(), self.ctx.max_norm)
        self.norms.append(norm.detach())  # read back at the end, not on the hot path
        return True

    def close(self) -> dict[str, Any]:
        norms = [float(n) for n in self.norms]
        active = sum(n > self.ctx.max_norm for n in norms) / max(1, len(norms))
        notes = {
            "max_norm": self.ctx.max_norm,
            "median_grad_norm": median(norms) if norms else None,
        }
        return {**super().close(), **notes, "clip_active_fraction": active}


class NaNCaptureRunner(Runner):
    """The callback approach: copy every batch and the RNG state, check one concatenation."""

    def before(self, batch: Batch) -> None:
        self.saved_batch = copy.deepcopy(batch)
        self.saved_rng = (torch.get_rng_state(), random.getstate())

    def after(self, loss: Tensor) -> bool:
        grads = [g.flatten() for g in self.ctx.grads()]
        return bool(torch.isfinite(torch.cat(grads)).all().item())


class PerParamRunner(Runner):
    def after(self, loss: Tensor) -> bool:
        for grad in self.ctx.grads():  # noqa: SIM110  (the loop is the point)
            if not torch.isfinite(grad).all().item():
                return False
        return True


class AnomalyRunner(Runner):
    anomaly = True


class GuardRunner(Runner):
    """Driven exactly like the README loop; ``watch()`` is advanced one step at a time."""

    def __init__(self, ctx: ModeContext, grad_clip: float | None, **options: Any) -> None:
        super().__init__(ctx)
        config = tg.GuardConfig(run_dir=ctx.run_dir, capture=True, grad_clip=grad_clip, **options)
        self.guard = tg.Guard(ctx.model, ctx.optimizer, config=config)
        self.stream = iter(self.guard.watch(ctx.batches))

    def fetch(self) -> Batch:
        batch: Batch = next(self.stream)
        return batch

    def after(self, loss: Tensor) -> bool:
        return self.guard.check(loss)

    def close(self) -> dict[str, Any]:
        self.guard.close()
        state = self.guard.state
        return {**super().close(), "guard_steps": state.step, "nonfinite": state.total_nonfinite}


class GuardStepRunner(GuardRunner):
    """``guard.step(loss)``: check, optimizer step and zero_grad in one call. With the fused
    AdamW of this mode the step is sync-free (the flags are read one step later)."""

    owns_step = True

    def after(self, loss: Tensor) -> bool:
        self.guard.step(loss)  # the outcome is not tested: testing it would wait for the device
        return True


def make_runner(mode: str, ctx: ModeContext) -> Runner:
    if mode == "guard":
        return GuardRunner(ctx, grad_clip=None)
    if mode == "guard_lean":
        return GuardRunner(ctx, grad_clip=None, on_spike="off", check_inputs=False)
    if mode == "guard_step":
        return GuardStepRunner(ctx, grad_clip=None)
    if mode == "guard_clip":
        return GuardRunner(ctx, grad_clip=ctx.max_norm)
    runners: dict[str, Callable[[ModeContext], Runner]] = {
        "bare": Runner,
        "foreach_norm": ForeachNormRunner,
        "norm_allreduce": NormAllReduceRunner,
        "bare_clip": ClipRunner,
        "nancapture": NaNCaptureRunner,
        "per_param": PerParamRunner,
        "detect_anomaly": AnomalyRunner,
        "bare_fused": Runner,
    }
    return runners[mode](ctx)
