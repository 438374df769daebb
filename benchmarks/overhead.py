"""Step-time overhead of trainguard against bare training and the naive NaN checks.

Two reference workloads: a ~25M-parameter MLP stack with a small batch (parameter-heavy:
the gradient pass matters) and a small GPT-style transformer (compute-heavy), in one process
and in 2-rank DDP on gloo. Every mode gets its own model (same initial weights), optimizer and
batches, built up front; then, round after round, the modes run ONE training step each in a
freshly shuffled order (the same order on every rank), so drift of the machine hits every mode
alike. Per mode: the median step time, the ratio to its reference as the median of the
per-round ratios, and the overhead as the median of the per-round differences.

    python benchmarks/overhead.py                         # everything (several minutes)
    python benchmarks/overhead.py --workload mlp --world 1 --rounds 20
    python benchmarks/overhead.py --quick --world 1       # tiny sizes: a smoke test
    python benchmarks/overhead.py --update-docs docs/benchmarks.md

Prints markdown tables, writes JSON (``--out``) and, with ``--update-docs``, replaces the
results block of the page.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import itertools
import json
import math
import os
import random
import shlex
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.multiprocessing.spawn import start_processes
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    bootstrap_ci,
    cpus_available,
    load_average,
    machine_info,
    markdown_table,
    median,
    now_iso,
    quartiles,
    replace_block,
    write_json,
)

import trainguard as tg

Batch = tuple[Tensor, Tensor]
Sample = dict[str, float]
"""One timed step: milliseconds per phase plus ``total``."""

PHASES = ("fetch", "pre", "fwd_bwd", "check", "optim")
DOCS_BLOCK = "overhead-results"


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


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        out: Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class TinyGPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final norm, untied LM head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        out: Tensor = self.head(self.ln(self.blocks(self.tok(tokens) + self.pos(pos))))
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
    row as small as the guard's, one host read."""

    def after(self, loss: Tensor) -> bool:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(self.ctx.grads(), 2.0)))
        row = torch.stack([loss.detach(), loss.detach(), norm]).to(torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            row = torch.cat([row, row.new_zeros(2)]).repeat(dist.get_world_size())
            dist.all_reduce(row)
        return bool(torch.isfinite(row).all())


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

    def __init__(self, ctx: ModeContext, grad_clip: float | None) -> None:
        super().__init__(ctx)
        self.guard = tg.Guard(
            ctx.model, ctx.optimizer, run_dir=ctx.run_dir, capture=True, grad_clip=grad_clip
        )
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


# -- measurement ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    workloads: tuple[str, ...]
    worlds: tuple[int, ...]
    modes: tuple[str, ...]
    rounds: int
    warmup: int
    slow_every: int
    sizes: str
    """Key of SIZES: ``quick`` (smoke test), ``cpu`` (the default), ``gpu``."""
    seed: int
    threads: int | None
    max_norm: float | None
    device: str = "cpu"
    """``cpu`` or ``cuda`` (each rank then uses ``cuda:<rank>``, DDP over NCCL)."""
    batches_per_mode: int = 4


def threads_for(settings: Settings, world: int) -> int:
    """Threads per process: the CPUs split among the ranks (2 alone, 1 each for 2 ranks here)."""
    if settings.threads is not None:
        return settings.threads
    return max(1, cpus_available() // world)


def device_for(settings: Settings, rank: int) -> torch.device:
    if settings.device == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def build_context(
    workload: Workload, mode: str, settings: Settings, rank: int, world: int, run_root: Path
) -> ModeContext:
    torch.manual_seed(settings.seed)  # same initial weights in every mode
    device = device_for(settings, rank)
    model = workload.build().to(device)
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids)
    fused = True if MODES[mode].fused else None  # None: torch's default (foreach)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, fused=fused)
    gen = torch.Generator().manual_seed(settings.seed + 1000 * (rank + 1))  # per-rank data
    pool: list[Batch] = []
    for _ in range(settings.batches_per_mode):
        inputs, targets = workload.batch(gen)
        pool.append((inputs.to(device), targets.to(device)))
    return ModeContext(
        model=model,
        optimizer=optimizer,
        batches=itertools.cycle(pool),
        loss_fn=workload.loss,
        max_norm=settings.max_norm if settings.max_norm is not None else workload.clip_norm,
        run_dir=run_root / workload.name / f"world{world}" / mode,
        clock=synced_clock if device.type == "cuda" else time.perf_counter,
        phase_clock=time.perf_counter,
    )


def synced_clock() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def round_order(modes: list[str], seed: int, round_index: int) -> list[str]:
    """The modes of one round in shuffled order; identical on every rank."""
    order = list(modes)
    random.Random(f"{seed}:{round_index}").shuffle(order)
    return order


def watchdog_cpu_ms() -> tuple[int, float]:
    """Live trainguard watchdog threads of this process, and the CPU ms they used so far.

    They run in the background while every mode steps, so interleaving spreads their cost
    over all modes; this measures it separately (Linux; 10 ms granularity).
    """
    ticks, count = 0, 0
    for thread in threading.enumerate():
        if not thread.name.startswith("trainguard-watchdog") or not thread.native_id:
            continue
        try:
            stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text(encoding="utf-8")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # fields from the 3rd on: utime, stime = 14, 15
        ticks += int(fields[11]) + int(fields[12])
        count += 1
    return count, 1e3 * ticks / os.sysconf("SC_CLK_TCK")


def interleave(
    runners: dict[str, Runner], settings: Settings, log: bool
) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Warm-up rounds, then timed rounds of one step per mode; None where a slow mode sat out.

    Also returns what the guards' background threads cost during the timed rounds."""
    names = list(runners)
    for r in range(settings.warmup):
        for name in round_order(names, settings.seed, -1 - r):
            runners[name].step()
    samples: dict[str, list[Any]] = {name: [] for name in names}
    _, cpu_before = watchdog_cpu_ms()
    started = time.monotonic()
    for r in range(settings.rounds):
        gc.collect()
        for name in round_order(names, settings.seed, r):
            if MODES[name].slow and r % settings.slow_every:
                samples[name].append(None)
            else:
                samples[name].append(runners[name].step())
        if log and (r + 1) % 10 == 0:
            elapsed = time.monotonic() - started
            print(f"  round {r + 1}/{settings.rounds} ({elapsed:.0f} s)", file=sys.stderr)
    threads, cpu_after = watchdog_cpu_ms()
    wall_s = time.monotonic() - started
    background = {
        "watchdog_threads": threads,
        "watchdog_cpu_ms": cpu_after - cpu_before,
        "wall_s": wall_s,
        "watchdog_core_percent_each": 100
        * (cpu_after - cpu_before)
        / 1e3
        / wall_s
        / max(1, threads),
    }
    return samples, background


def measure_workload(
    workload: Workload, settings: Settings, rank: int, world: int, run_root: Path
) -> dict[str, Any]:
    """Build every mode, interleave them, summarize (the summary is this rank's)."""
    runners = {
        mode: make_runner(mode, build_context(workload, mode, settings, rank, world, run_root))
        for mode in settings.modes
    }
    params = sum(p.numel() for p in runners[settings.modes[0]].ctx.model.parameters())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        samples, background = interleave(runners, settings, log=rank == 0)
    notes = {mode: runner.close() for mode, runner in runners.items()}
    return {
        "workload": workload.name,
        "description": workload.description.format(**workload.sizes),
        "sizes": workload.sizes,
        "parameters": params,
        "world": world,
        "threads": torch.get_num_threads(),
        "device": str(device_for(settings, rank)),
        "rounds": settings.rounds,
        "warmup": settings.warmup,
        "modes": {mode: summarize(mode, samples, notes[mode]) for mode in settings.modes},
        "background": background,
    }


AROUND = ("fetch", "pre", "check")
"""The phases around forward/backward, where a check does its work."""


def summarize(mode: str, samples: dict[str, list[Any]], notes: dict[str, Any]) -> dict[str, Any]:
    """Median step time; ratio and overhead against the reference, paired round by round."""
    mine = samples[mode]
    totals = [s["total"] for s in mine if s is not None]
    reference = MODES[mode].reference
    out: dict[str, Any] = {
        "description": MODES[mode].description,
        "reference": reference,
        "rounds_measured": len(totals),
        "median_ms": median(totals),
        "phases_ms": {p: median([s[p] for s in mine if s is not None]) for p in PHASES},
        "step_ms": [round(t, 3) for t in totals],
        "around_ms_rounds": [round(_around(s), 4) for s in mine if s is not None],
        **notes,
    }
    out.update(ratio=None, ratio_p25=None, ratio_p75=None, overhead_ms=None, around_ms=None)
    if reference is None or reference not in samples:
        return out
    pairs = [
        (s, ref)
        for s, ref in zip(mine, samples[reference], strict=True)
        if s is not None and ref is not None
    ]
    ratios = [s["total"] / ref["total"] for s, ref in pairs]
    p25, p75 = quartiles(ratios)
    out.update(
        ratio=median(ratios),
        ratio_p25=p25,
        ratio_p75=p75,
        overhead_ms=median([s["total"] - ref["total"] for s, ref in pairs]),
        around_ms=median([_around(s) - _around(ref) for s, ref in pairs]),
    )
    return out


def _around(sample: Sample) -> float:
    return sum(sample[p] for p in AROUND)


# -- processes --------------------------------------------------------------------------------


def run_single(workload: Workload, settings: Settings, run_root: Path) -> dict[str, Any]:
    torch.set_num_threads(threads_for(settings, 1))
    return measure_workload(workload, settings, 0, 1, run_root)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ddp_worker(
    rank: int,
    world: int,
    port: int,
    workload: Workload,
    settings: Settings,
    run_root: str,
    out: str,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_for(settings, world))
    backend = "nccl" if settings.device == "cuda" else "gloo"
    if settings.device == "cuda":
        torch.cuda.set_device(device_for(settings, rank))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        result = measure_workload(workload, settings, rank, world, Path(run_root))
        if rank == 0:
            write_json(Path(out), result)
    finally:
        dist.destroy_process_group()


def run_ddp(workload: Workload, settings: Settings, world: int, run_root: Path) -> dict[str, Any]:
    out = run_root / f"{workload.name}-world{world}.json"
    args = (world, _free_port(), workload, settings, str(run_root), str(out))
    start_processes(_ddp_worker, args=args, nprocs=world, join=True, start_method="spawn")
    result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return result


# -- targets and report -----------------------------------------------------------------------


def _mode(result: dict[str, Any], name: str) -> dict[str, Any] | None:
    modes: dict[str, dict[str, Any]] = result["modes"]
    return modes.get(name)


FLOOR_LIMIT = 1.1
"""``guard`` against ``norm_allreduce`` under DDP: our own target, not the issue's."""


def evaluate_targets(results: list[dict[str, Any]], device: str = "cpu") -> list[dict[str, Any]]:
    """The issue's targets, checked on whatever this run measured.

    On CUDA the phases are host time, so the own-phase comparisons are left out."""
    how_many: tuple[tuple[str, str], ...] = (("overhead_ms", "step time"),)
    if device != "cuda":
        how_many += (("around_ms", "own phases"),)
    targets: list[dict[str, Any]] = []
    for res in results:
        where = {"workload": res["workload"], "world": res["world"]}
        ratios = [("guard_clip", 1.01)]
        if res["workload"] == "transformer":
            ratios = [("guard", 1.02), ("guard_step", 1.02), *ratios]
        for mode, limit in ratios:
            m = _mode(res, mode)
            if m:
                name = f"{mode} / {m['reference']}"
                ci = _ci(res, functools.partial(_ratio, res, mode, m["reference"]))
                targets.append(_target(where, name, m["ratio"], limit, ci))
        guard = _mode(res, "guard")
        if res["workload"] != "mlp" or not guard:
            continue
        baselines = [("nancapture", 0.1), ("foreach_norm", 1.5)]
        if res["world"] > 1:  # ours, not the issue's: the guard at the floor of an agreed check
            baselines.append(("norm_allreduce", FLOOR_LIMIT))
        for baseline, factor in baselines:
            base = _mode(res, baseline)
            if not base:
                continue
            for key, how in how_many:
                if base[key] and base[key] > 0:
                    value = guard[key] / base[key]
                    name = f"guard overhead / {baseline} overhead ({how})"
                    field = "step_ms" if key == "overhead_ms" else "around_ms_rounds"
                    ci = None
                    if field in guard:  # runs before the field was recorded have no interval
                        stat = functools.partial(_overheads, res, "guard", baseline, field)
                        ci = _ci(res, stat)
                    targets.append(_target(where, name, value, factor, ci))
    return targets


def _rounds(res: dict[str, Any], mode: str, field: str = "step_ms") -> list[float]:
    """The mode's step times (or own-phase times), round by round (aligned across the modes
    that ran every round)."""
    times: list[float] = res["modes"][mode][field]
    return times


def _ratio(res: dict[str, Any], mode: str, reference: str, rounds: list[int]) -> float:
    a, b = _rounds(res, mode), _rounds(res, reference)
    return median([a[i] / b[i] for i in rounds])


def _overheads(
    res: dict[str, Any], mode: str, baseline: str, field: str, rounds: list[int]
) -> float:
    """Median overhead of ``mode`` over that of ``baseline`` (both against bare)."""
    bare = _rounds(res, "bare", field)
    mine = median([_rounds(res, mode, field)[i] - bare[i] for i in rounds])
    theirs = median([_rounds(res, baseline, field)[i] - bare[i] for i in rounds])
    return mine / theirs if theirs > 0 else math.inf


def _ci(res: dict[str, Any], statistic: Callable[[list[int]], float]) -> list[float | None] | None:
    """95% bootstrap interval over the rounds (None when the modes' rounds do not align).

    A bound is None where it is not finite: a ratio of overheads whose denominator is not
    positive in some resamples (the baseline's overhead is lost in the noise)."""
    n = len(_rounds(res, "bare")) if "bare" in res["modes"] else 0
    if n < 5:
        return None
    try:
        low, high = bootstrap_ci(n, statistic)
    except IndexError:  # a mode skipped rounds
        return None
    return [b if math.isfinite(b) else None for b in (low, high)]


def _target(
    where: dict[str, Any],
    name: str,
    value: float | None,
    limit: float,
    ci: list[float | None] | None = None,
) -> dict[str, Any]:
    """``met``: the median is within the limit; ``verdict`` also asks the 95% interval
    (a None bound is unbounded)."""
    ok = value is not None and value <= limit
    if ci is None:
        verdict = "met" if ok else "missed"
    elif ci[1] is not None and ci[1] <= limit:
        verdict = "met"
    elif ci[0] is not None and ci[0] > limit:
        verdict = "missed"
    else:
        verdict = "within noise"
    return {
        **where,
        "target": name,
        "value": value,
        "ci95": ci,
        "limit": limit,
        "met": ok,
        "verdict": verdict,
    }


MAIN_HEADERS = (
    "workload",
    "world",
    "mode",
    "step ms",
    "vs",
    "ratio",
    "ratio p25",
    "ratio p75",
    "overhead ms",
    "around ms",
)


def main_table(results: list[dict[str, Any]]) -> str:
    rows = []
    for res in results:
        for mode, m in res["modes"].items():
            rows.append(
                [
                    res["workload"],
                    res["world"],
                    mode,
                    m["median_ms"],
                    m["reference"] or "",
                    m["ratio"],
                    m["ratio_p25"],
                    m["ratio_p75"],
                    m["overhead_ms"],
                    m["around_ms"],
                ]
            )
    return markdown_table(MAIN_HEADERS, rows)


def phase_table(results: list[dict[str, Any]]) -> str:
    rows = []
    for res in results:
        for mode, m in res["modes"].items():
            phases = m["phases_ms"]
            rows.append([res["workload"], res["world"], mode, *(phases[p] for p in PHASES)])
    return markdown_table(("workload", "world", "mode", *PHASES), rows)


def targets_table(targets: list[dict[str, Any]]) -> str:
    rows = [
        [
            t["workload"],
            t["world"],
            t["target"],
            t["value"],
            _interval(t.get("ci95")),
            f"<= {t['limit']}",
            _verdict(t),
        ]
        for t in targets
    ]
    headers = ("workload", "world", "target", "value", "95% interval", "limit", "verdict")
    return markdown_table(headers, rows)


def _interval(ci: list[float | None] | None) -> str:
    if ci is None:
        return "-"
    low, high = ("unbounded" if b is None else f"{b:.3f}" for b in ci)
    return f"{low} .. {high}"


def _verdict(target: dict[str, Any]) -> str:
    verdict = target.get("verdict") or ("met" if target["met"] else "missed")
    return {"met": "met", "missed": "**missed**"}.get(verdict, verdict)


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"


def _describe(res: dict[str, Any]) -> str:
    backend = "nccl" if res.get("device", "cpu").startswith("cuda") else "gloo"
    world = res["world"]
    setup = "one process" if world == 1 else f"{world}-rank DDP, {backend}, rank 0's times"
    text = (
        f"- {res['workload']}, {setup}: {res['description']}; {_count(res['parameters'])} "
        f"parameters; {res['threads']} thread(s) per process; {res['rounds']} rounds after "
        f"{res['warmup']} warm-up rounds."
    )
    bg = res["background"]
    if bg["watchdog_threads"]:
        text += (
            f" Watchdog threads: {bg['watchdog_threads']}, each using "
            f"{bg['watchdog_core_percent_each']:.2f}% of a core in the background "
            "(spread over every mode's step times)."
        )
    return text


def render(report: dict[str, Any]) -> str:
    machine = report["machine"]
    results = report["results"]
    lines = [
        f"Measured {report['date']} with `{report['command']}`",
        "",
        f"Machine: {machine['cpu']}, {machine['cpus_available']} CPUs, "
        f"{machine['memory_gib']} GiB, {machine['platform']}; Python {machine['python']}, "
        f"torch {machine['torch']}; device {report['settings']['device']}"
        + (f" ({machine['gpu']}, CUDA {machine['cuda_version']})" if machine.get("gpu") else "")
        + ". "
        f"Load average at start {report['load_average_start']}, "
        f"at end {report['load_average_end']}.",
        "",
    ]
    lines += [_describe(res) for res in results]
    if report["settings"]["device"] == "cuda":
        lines += [
            "",
            "On CUDA the step is timed from a `torch.cuda.synchronize()` before fetching the "
            "batch to one after `zero_grad()`, so it holds all of the step's GPU work; the "
            "phases inside it are host time (a mode that waits for the device shows the wait "
            "in the phase where it waits).",
        ]
    lines += ["", "Step time (median), ratio to the reference (median of per-round ratios):", ""]
    lines += [main_table(results), "", "Targets:", ""]
    if report["settings"]["device"] == "cuda":
        lines += [
            "The targets were set for the 2-core CPU machine; on CUDA they are shown for "
            "comparison, on step time only.",
            "",
        ]
    lines += [targets_table(report["targets"]), ""]
    lines += ["Median milliseconds per phase of the step:", "", phase_table(results)]
    return "\n".join(lines)


def _load_report(path: Path) -> dict[str, Any]:
    """A report written earlier, its targets evaluated again (with today's rules)."""
    try:
        report: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--from-json {path}: cannot read a report ({exc})") from None
    report["targets"] = evaluate_targets(report["results"], report["settings"]["device"])
    return report


def render_targets_of_runs(reports: list[dict[str, Any]]) -> str:
    """Every target that several runs measured, one row per run and target, with the runs'
    commands: how far a verdict moves from run to run."""
    rows, commands = [], []
    for number, report in enumerate(reports, start=1):
        commands.append(f"{number}. {report['date'][:16]}: `{report['command']}`")
        rounds = {(r["workload"], r["world"]): r["rounds"] for r in report["results"]}
        for t in report["targets"]:
            where = (t["workload"], t["world"])
            rows.append([number, *where, rounds[where], t["target"], t["value"]])
            rows[-1] += [_interval(t.get("ci95")), f"<= {t['limit']}", _verdict(t)]
    headers = ("run", "workload", "world", "rounds", "target", "value", "95% interval")
    table = markdown_table((*headers, "limit", "verdict"), rows)
    return "\n".join(["Runs:", "", *commands, "", table])


# -- command line -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("mlp", "transformer", "all"), default="all")
    parser.add_argument("--world", choices=("1", "2", "all"), default="all")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 30; 3 with --quick)")
    parser.add_argument("--warmup", type=int, help="untimed rounds first (default 3; 1 --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument(
        "--sizes",
        choices=("cpu", "gpu"),
        default="cpu",
        help="workload sizes: cpu (a step of 0.1-1 s on 2 cores) or gpu (tens of ms on an H100)",
    )
    parser.add_argument("--modes", help=f"comma-separated subset of: {', '.join(MODES)}")
    parser.add_argument(
        "--slow-every", type=int, default=1, help="run detect_anomaly every N-th round only"
    )
    parser.add_argument("--max-norm", type=float, help="clip norm (default: per workload)")
    parser.add_argument(
        "--threads", type=int, help="torch threads per process (default: CPUs/world)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks/overhead.json"))
    parser.add_argument("--update-docs", type=Path, metavar="PAGE", help="e.g. docs/benchmarks.md")
    parser.add_argument(
        "--docs-block",
        default=DOCS_BLOCK,
        help=f"the marked block of PAGE to replace (default {DOCS_BLOCK})",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="measure nothing: render a report written earlier (e.g. on a GPU machine); "
        "with several files, one table of every target they measured",
    )
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = Settings(
        workloads=("mlp", "transformer") if args.workload == "all" else (args.workload,),
        worlds=(1, 2) if args.world == "all" else (int(args.world),),
        modes=_modes(args.modes, device),
        rounds=args.rounds if args.rounds is not None else (3 if args.quick else 30),
        warmup=args.warmup if args.warmup is not None else (1 if args.quick else 3),
        slow_every=max(1, args.slow_every),
        sizes="quick" if args.quick else args.sizes,
        seed=args.seed,
        threads=args.threads,
        max_norm=args.max_norm,
        device=device,
    )
    if settings.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if settings.rounds < 1 or settings.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    return settings, args


def _modes(spec: str | None, device: str) -> tuple[str, ...]:
    """The chosen modes in table order, with the references they are compared against."""
    if spec:
        wanted = {m.strip() for m in spec.split(",") if m.strip()}
    else:
        wanted = {m for m, s in MODES.items() if device == "cuda" or not s.cuda_only_default}
    unknown = wanted - set(MODES)
    if unknown:
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    for mode in list(wanted):
        reference = MODES[mode].reference
        while reference is not None:
            wanted.add(reference)
            reference = MODES[reference].reference
    return tuple(m for m in MODES if m in wanted)


def run(settings: Settings) -> list[dict[str, Any]]:
    specs = workloads(settings.sizes)
    results = []
    with tempfile.TemporaryDirectory(prefix="tg-bench-") as tmp:
        for name in settings.workloads:
            for world in settings.worlds:
                if settings.device == "cuda" and world > torch.cuda.device_count():
                    print(
                        f"{name}, world {world}: skipped, {torch.cuda.device_count()} GPU(s) "
                        "here (NCCL needs one GPU per rank)",
                        file=sys.stderr,
                    )
                    continue
                threads = threads_for(settings, world)
                print(
                    f"{name}, world {world}: {len(settings.modes)} modes, {settings.rounds} "
                    f"rounds, {threads} thread(s) per process",
                    file=sys.stderr,
                )
                workload = specs[name]
                if world == 1:
                    results.append(run_single(workload, settings, Path(tmp)))
                else:
                    results.append(run_ddp(workload, settings, world, Path(tmp)))
                gc.collect()
    return results


def measure(settings: Settings, argv: list[str] | None) -> dict[str, Any]:
    command = shlex.join(["python", "benchmarks/overhead.py", *(argv or sys.argv[1:])])
    load_start = load_average()
    results = run(settings)
    return {
        "benchmark": "overhead",
        "date": now_iso(),
        "command": command,
        "settings": asdict(settings),
        "machine": machine_info(),
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "results": results,
        "targets": evaluate_targets(results, settings.device),
    }


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    if args.from_json is not None:
        several = len(args.from_json) > 1
        if several and args.update_docs is not None and args.docs_block == DOCS_BLOCK:
            raise SystemExit(
                "--from-json with several files renders a table of targets, not a report: "
                f"name its block with --docs-block (not {DOCS_BLOCK})"
            )
        reports = [_load_report(path) for path in args.from_json]
        text = render(reports[0]) if len(reports) == 1 else render_targets_of_runs(reports)
    else:
        report = measure(settings, argv)
        write_json(args.out, report)
        print(f"\nJSON: {args.out}", file=sys.stderr)
        text = render(report)
    print(text)
    if args.update_docs is not None:
        replace_block(args.update_docs, args.docs_block, text)
        print(f"updated {args.update_docs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
