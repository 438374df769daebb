"""What does the guard cost per training step, against bare training and the naive checks?

Workloads (``_workloads.py``): an MLP stack (parameter-heavy: a pass over the gradients
shows) and a small GPT-style transformer (compute-heavy: what a real step looks like), in
float32 and under bf16 autocast, in one process and in 2-rank DDP (gloo on the CPU, NCCL on
GPUs). ``--workload bnconv`` adds a BatchNorm conv net, the one model here whose forward
writes buffers (what ``restore_buffers`` copies).

Every mode trains its own copy of the model (same initial weights) on its own pre-built
batches; then, round after round, every mode takes ONE step, in a freshly shuffled order
(the same on every rank), so drift of the machine hits every mode alike. Per mode: the
median step time; against its reference (``vs``) the median of the per-round ratios with
a 95% bootstrap interval over the rounds, and the median per-round difference (``+ms``).

Modes (``MODES``): ``bare``; the naive checks (``naive``: ``isfinite(g).all().item()`` per
gradient; ``nancapture``: a NaNCapture-style callback; ``foreach_norm``: one fused norm
pass, the floor of any check that reads the gradients; ``detect_anomaly`` on request);
``guard`` (``watch()`` + ``check()``, the README loop), ``guard_step`` (``guard.step()``
with ``AdamW(fused=True)``: the sync-free step, against ``bare_fused``), ``guard_clip``
(``grad_clip``, against ``clip_grad_norm_``); and the guard with one feature switched
(``guard-inputs``, ``guard-spikes``, ``guard-restore``, ``guard-stragglers``,
``guard-replicas``, ``guard+replicas``, ``guard+rerun``), whose ratio to ``guard`` is what
the feature costs (the "features" table). Straggler and replica modes run under DDP only.

On CUDA each step is timed from a ``synchronize()`` to a ``synchronize()``, and the host
syncs of every mode's step are counted afterwards with ``torch.cuda.set_sync_debug_mode``
(the sync-free ``guard_step`` must show 0).

    python benchmarks/overhead.py                        # everything, 30 rounds (long)
    python benchmarks/overhead.py --workload transformer --world 1 --precision fp32
    python benchmarks/overhead.py --modes bare,guard,guard-stragglers --world 2
    python benchmarks/overhead.py --device cuda          # GPU sizes, NCCL, sync counts
    python benchmarks/overhead.py --quick                # seconds: a smoke run
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import itertools
import json
import math
import os
import random
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.multiprocessing.spawn import start_processes
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    bootstrap_ci,
    cpus_available,
    finish,
    finish_args,
    free_port,
    header,
    interval,
    markdown_table,
    median,
    paired,
    parser,
    quick_dns,
    round_order,
    verdict,
    write_json,
)
from _workloads import Batch, Workload, workload

import trainguard as tg

NAME = "overhead"


@dataclass(frozen=True)
class ModeSpec:
    description: str
    reference: str | None = "bare"
    naive: str | None = None
    """The hand-written check of a non-guard mode: ``foreach_norm``, ``naive``,
    ``nancapture``, ``clip``, ``anomaly``."""
    guard: dict[str, Any] | None = None
    """The options of a guarded mode, by the names ``tg.Guard`` takes as keywords (a
    section's option as ``section.option``); None: no guard."""
    clip: bool = False
    step: bool = False
    """``guard.step(loss)`` instead of ``if guard.check(loss): optimizer.step()``."""
    fused: bool = False
    rerun: bool = False
    min_world: int = 1
    group: str = "core"


MODES: dict[str, ModeSpec] = {
    "bare": ModeSpec("forward, backward, optimizer.step(), zero_grad()", None),
    "foreach_norm": ModeSpec(
        "bare + one torch._foreach_norm over the gradients: the floor of a gradient check",
        naive="foreach_norm",
    ),
    "naive": ModeSpec(
        "bare + isfinite(loss).item() and isfinite(g).all().item() per gradient", naive="naive"
    ),
    "nancapture": ModeSpec(
        "NaNCapture-style callback: deepcopy(batch) + RNG states per step, "
        "isfinite(torch.cat(grads)).all().item()",
        naive="nancapture",
    ),
    "detect_anomaly": ModeSpec(
        "forward and backward under torch.autograd.detect_anomaly()",
        naive="anomaly",
        group="slow",
    ),
    "guard": ModeSpec(
        "Guard defaults: for batch in guard.watch(...); if guard.check(loss): opt.step()",
        guard={},
    ),
    "bare_fused": ModeSpec("bare with AdamW(fused=True)", None, fused=True),
    "guard_step": ModeSpec(
        "Guard defaults, guard.step(loss) with AdamW(fused=True): the sync-free step",
        "bare_fused",
        guard={},
        step=True,
        fused=True,
    ),
    "bare_clip": ModeSpec("bare + clip_grad_norm_(max_norm)", naive="clip"),
    "guard_clip": ModeSpec(
        "Guard defaults with grad_clip=max_norm", "bare_clip", guard={}, clip=True
    ),
    "guard-inputs": ModeSpec(
        "guard, inputs.check=False", "guard", guard={"inputs.check": False}, group="features"
    ),
    "guard-spikes": ModeSpec(
        "guard, on_spike='off'", "guard", guard={"on_spike": "off"}, group="features"
    ),
    "guard-restore": ModeSpec(
        "guard, restore_buffers=False", "guard", guard={"restore_buffers": False}, group="features"
    ),
    "guard-stragglers": ModeSpec(
        "guard, health.detect_stragglers=False",
        "guard",
        guard={"health.detect_stragglers": False},
        min_world=2,
        group="features",
    ),
    "guard-replicas": ModeSpec(
        "guard, replica_check_every=0",
        "guard",
        guard={"replica_check_every": 0},
        min_world=2,
        group="features",
    ),
    "guard+replicas": ModeSpec(
        "guard, replica_check_every=1 (default 5)",
        "guard",
        guard={"replica_check_every": 1},
        min_world=2,
        group="features",
    ),
    "guard+rerun": ModeSpec(
        "guard, rerun=loss_fn (good steps: nothing is rerun)",
        "guard",
        guard={},
        rerun=True,
        group="features",
    ),
}

FEATURES: dict[str, tuple[str, str]] = {
    "input check (inputs.check)": ("guard", "guard-inputs"),
    "spike rule (on_spike='warn')": ("guard", "guard-spikes"),
    "buffer restore (restore_buffers)": ("guard", "guard-restore"),
    "straggler timing (health.detect_stragglers)": ("guard", "guard-stragglers"),
    "replica check every 5 steps (the default)": ("guard", "guard-replicas"),
    "replica check every step": ("guard+replicas", "guard"),
    "rerun=loss_fn, good steps": ("guard+rerun", "guard"),
}
"""Each feature's cost: the mode with it on over the mode with it off, in the same rounds."""

GROUPS = {
    "core": [m for m, s in MODES.items() if s.group == "core"],
    "features": [m for m, s in MODES.items() if s.group == "features"],
    "all": list(MODES),
}


@dataclass(frozen=True)
class Settings:
    workloads: tuple[str, ...]
    worlds: tuple[int, ...]
    precisions: tuple[str, ...]
    modes: tuple[str, ...]
    rounds: int
    warmup: int
    sizes: str
    device: str
    seed: int
    threads: int | None
    sync_steps: int
    batches_per_mode: int = 4
    extra: dict[str, Any] = field(default_factory=dict)


# -- one mode's step ----------------------------------------------------------------------------


class Runner:
    """One mode: its model (DDP-wrapped under DDP), optimizer, batches and step."""

    def __init__(
        self,
        name: str,
        work: Workload,
        settings: Settings,
        world: int,
        precision: str,
        run_dir: Path,
    ) -> None:
        spec = MODES[name]
        self.name, self.spec, self.work = name, spec, work
        rank = dist.get_rank() if world > 1 else 0
        self.device = _device(settings.device, rank)
        torch.manual_seed(settings.seed)  # the same initial weights in every mode
        model = work.build().to(self.device)
        if world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=ids)
        self.model: nn.Module = model
        fused = True if spec.fused else None  # None: torch's default (foreach)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=work.lr, fused=fused)
        gen = torch.Generator().manual_seed(settings.seed + 1000 * (rank + 1))  # per-rank data
        pool = [
            tuple(t.to(self.device) for t in work.batch(gen))
            for _ in range(settings.batches_per_mode)
        ]
        self.batches: Iterator[Any] = itertools.cycle(pool)
        dtype = torch.bfloat16 if precision == "bf16" else None
        self.autocast = functools.partial(
            torch.autocast, self.device.type, dtype=dtype, enabled=dtype is not None
        )
        self.guard: tg.Guard | None = None
        if spec.guard is not None:
            options = dict(spec.guard)  # Guard's options by name (GuardConfig.from_options)
            if spec.clip:
                options["grad_clip"] = work.clip_norm
            rerun = work.loss if spec.rerun else None
            self.guard = tg.Guard(model, self.optimizer, run_dir=run_dir, rerun=rerun, **options)
            self.batches = iter(self.guard.watch(self.batches))
        self.skipped = 0

    def step(self, clock: bool = True) -> dict[str, float]:
        """One training step, timed: ``total`` and ``own`` (the step without forward,
        backward and the optimizer step: where a check does its work), milliseconds. On
        CUDA the step runs from a ``synchronize()`` to a ``synchronize()`` (``clock``)."""
        sync = clock and self.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        batch = next(self.batches)
        saved = self._before(batch)
        t1 = time.perf_counter()
        anomaly = torch.autograd.detect_anomaly() if self.spec.naive == "anomaly" else None
        with anomaly or contextlib.nullcontext(), self.autocast():
            loss = self.work.loss(self.model, batch)
        with anomaly or contextlib.nullcontext():
            loss.backward()
        t2 = time.perf_counter()
        ok = self._check(loss)
        t3 = time.perf_counter()
        if not self.spec.step:
            if ok:
                self.optimizer.step()
            else:
                self.skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
        if sync:
            torch.cuda.synchronize(self.device)
        t4 = time.perf_counter()
        del saved
        return {"total": 1e3 * (t4 - t0), "own": 1e3 * ((t1 - t0) + (t3 - t2))}

    def _before(self, batch: Batch) -> Any:
        if self.spec.naive == "nancapture":  # the callback's copies at the step's start
            rng: list[Any] = [torch.get_rng_state(), random.getstate()]
            if self.device.type == "cuda":
                rng.append(torch.cuda.get_rng_state_all())
            return copy.deepcopy(batch), rng
        return None

    def _grads(self) -> list[Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def _check(self, loss: Tensor) -> bool:
        naive = self.spec.naive
        if self.guard is not None:
            if self.spec.step:
                self.guard.step(loss)  # not tested: testing it would wait for the device
                return True
            return self.guard.check(loss)
        if naive == "foreach_norm":
            torch._foreach_norm(self._grads(), 2.0)
        elif naive == "naive":
            if not torch.isfinite(loss).item():
                return False
            for grad in self._grads():
                if not torch.isfinite(grad).all().item():
                    return False
        elif naive == "nancapture":
            flat = torch.cat([g.flatten() for g in self._grads()])
            return bool(torch.isfinite(flat).all().item())
        elif naive == "clip":
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.work.clip_norm)
        return True

    def close(self) -> dict[str, Any]:
        notes: dict[str, Any] = {"skipped_steps": self.skipped}
        if self.guard is not None:
            self.guard.close()
            notes["guard_steps"] = self.guard.state.step
            notes["nonfinite"] = self.guard.state.total_nonfinite
        return notes


def _device(kind: str, rank: int) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def count_syncs(runner: Runner, steps: int) -> float | None:
    """Host syncs PyTorch reports per step of ``runner`` (CUDA only; the median of
    ``steps`` steps after one more), the step's own: no synchronizing clock around it."""
    if runner.device.type != "cuda" or steps < 1:
        return None
    runner.step()
    counts = []
    for _ in range(steps):
        torch.cuda.synchronize(runner.device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                runner.step(clock=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    return median(counts)


# -- one configuration: workload x precision x world --------------------------------------------


def modes_for(settings: Settings, world: int) -> list[str]:
    return [m for m in settings.modes if MODES[m].min_world <= world]


def measure(
    work: Workload, precision: str, settings: Settings, world: int, root: Path
) -> dict[str, Any]:
    """Every mode built, interleaved round by round, summarized (rank 0's times)."""
    names = modes_for(settings, world)
    run_root = root / f"{work.name}-{precision}-w{world}"
    runners = {n: Runner(n, work, settings, world, precision, run_root / n) for n in names}
    rank = dist.get_rank() if world > 1 else 0
    samples: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        for index in range(-settings.warmup, settings.rounds):
            gc.collect()
            for name in round_order(names, settings.seed, index):
                sample = runners[name].step()
                if index >= 0:
                    samples[name].append(sample)
        syncs = {n: count_syncs(r, settings.sync_steps) for n, r in runners.items()}
    notes = {n: r.close() for n, r in runners.items()}
    params = sum(p.numel() for p in runners[names[0]].model.parameters())
    modes = {n: summarize(n, samples, notes[n], syncs[n]) for n in names}
    return {
        "workload": work.name,
        "description": work.description,
        "parameters": params,
        "precision": precision,
        "world": world,
        "device": str(_device(settings.device, rank)),
        "threads": torch.get_num_threads(),
        "rounds": settings.rounds,
        "warmup": settings.warmup,
        "modes": modes,
        "features": features(samples),
    }


def summarize(
    name: str,
    samples: dict[str, list[dict[str, float]]],
    notes: dict[str, Any],
    syncs: float | None,
) -> dict[str, Any]:
    spec = MODES[name]
    total = [s["total"] for s in samples[name]]
    own = [s["own"] for s in samples[name]]
    out: dict[str, Any] = {
        "description": spec.description,
        "reference": spec.reference,
        "median_ms": median(total),
        "own_ms": median(own),
        "step_ms": [round(t, 4) for t in total],
        "own_ms_rounds": [round(t, 4) for t in own],
        "host_syncs_per_step": syncs,
        **notes,
    }
    ref = spec.reference
    if ref is not None and ref in samples:
        pair = paired(total, [s["total"] for s in samples[ref]])
        own_diffs = [o - s["own"] for o, s in zip(own, samples[ref], strict=True)]
        out.update(
            ratio=pair["ratio"],
            ratio_ci95=pair["ratio_ci95"],
            ratio_p25=pair["ratio_p25"],
            ratio_p75=pair["ratio_p75"],
            overhead_ms=pair["diff"],
            overhead_ci95=pair["diff_ci95"],
            # step() runs the optimizer step inside: its "own" part is not comparable
            own_overhead_ms=None if spec.step else median(own_diffs),
        )
    return out


def features(samples: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for feature, (on, off) in FEATURES.items():
        if on in samples and off in samples:
            pair = paired([s["total"] for s in samples[on]], [s["total"] for s in samples[off]])
            out[feature] = {"on": on, "off": off, **pair}
    return out


# -- processes ----------------------------------------------------------------------------------


def configs(settings: Settings) -> list[tuple[Workload, str]]:
    return [
        (workload(w, settings.sizes), p) for w in settings.workloads for p in settings.precisions
    ]


def threads_for(settings: Settings, world: int) -> int:
    return settings.threads or max(1, cpus_available() // world)


def run_single(settings: Settings, root: Path) -> list[dict[str, Any]]:
    torch.set_num_threads(threads_for(settings, 1))
    results = []
    for work, precision in configs(settings):
        print(f"{work.name}, {precision}, world 1", file=sys.stderr)
        results.append(measure(work, precision, settings, 1, root))
    return results


def _ddp_worker(rank: int, world: int, port: int, settings: Settings, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_for(settings, world))
    backend = "nccl" if settings.device == "cuda" else "gloo"
    if settings.device == "cuda":
        torch.cuda.set_device(_device(settings.device, rank))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(minutes=10))
    try:
        results = []
        for work, precision in configs(settings):
            if rank == 0:
                print(f"{work.name}, {precision}, world {world}", file=sys.stderr)
            results.append(measure(work, precision, settings, world, Path(root)))
        if rank == 0:
            write_json(Path(root) / f"world{world}.json", results)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ddp(settings: Settings, world: int, root: Path) -> list[dict[str, Any]]:
    if settings.device == "cuda" and torch.cuda.device_count() < world:
        print(f"world {world}: skipped, NCCL needs a GPU per rank", file=sys.stderr)
        return []
    quick_dns()
    args = (world, free_port(), settings, str(root))
    start_processes(_ddp_worker, args=args, nprocs=world, join=True, start_method="spawn")
    results: list[dict[str, Any]] = json.loads((root / f"world{world}.json").read_text())
    return results


# -- targets and tables -------------------------------------------------------------------------

TARGETS = (
    # (workload or None for any, mode, limit): the mode's ratio to its reference
    ("transformer", "guard", 1.02),
    ("transformer", "guard_step", 1.02),
    (None, "guard_clip", 1.01),
)
OVERHEAD_TARGETS = (("mlp", "nancapture", 0.1), ("mlp", "foreach_norm", 1.5))
"""The guard's overhead over bare at most this fraction of the naive mode's overhead."""


def evaluate_targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    targets = []
    for res in results:
        where = {k: res[k] for k in ("workload", "world", "precision")}
        modes = res["modes"]
        for wl, mode, limit in TARGETS:
            m = modes.get(mode)
            if m is None or "ratio" not in m or wl not in (None, res["workload"]):
                continue
            name = f"{mode} / {m['reference']}"
            targets.append(_target(where, name, m["ratio"], limit, m["ratio_ci95"]))
        guard, bare = modes.get("guard"), modes.get("bare")
        for wl, base, limit in OVERHEAD_TARGETS:
            naive = modes.get(base)
            if wl != res["workload"] or guard is None or naive is None or bare is None:
                continue
            stat = functools.partial(
                _overhead_ratio, guard["step_ms"], naive["step_ms"], bare["step_ms"]
            )
            value = stat(list(range(len(bare["step_ms"]))))
            n = len(bare["step_ms"])
            ci = list(bootstrap_ci(n, stat)) if n >= 5 else None
            name = f"guard overhead / {base} overhead"
            # infinite: the reference's own overhead was not above zero (noise)
            targets.append(_target(where, name, value, limit, ci, math.isfinite(value)))
        step = modes.get("guard_step")
        if step is not None and step["host_syncs_per_step"] is not None:
            syncs = step["host_syncs_per_step"]
            targets.append(_target(where, "guard_step host syncs per step", syncs, 0.0, None))
    return targets


def _overhead_ratio(
    guard: list[float], naive: list[float], bare: list[float], idx: list[int]
) -> float:
    mine = median(guard[i] - bare[i] for i in idx)
    theirs = median(naive[i] - bare[i] for i in idx)
    return mine / theirs if theirs > 0 else math.inf


def _target(
    where: dict[str, Any],
    name: str,
    value: float,
    limit: float,
    ci: list[float] | None,
    resolved: bool = True,
) -> dict[str, Any]:
    """One target's row; ``resolved`` False: the ratio's denominator (a reference's overhead)
    was not above zero in these rounds, so the verdict is ``unresolved``, not ``missed``."""
    finite_ci = ci if ci is not None and all(math.isfinite(b) for b in ci) else None
    return {
        **where,
        "target": name,
        "value": value if math.isfinite(value) else None,
        "ci95": finite_ci,
        "limit": limit,
        "verdict": verdict(value, limit, finite_ci) if resolved else "unresolved",
    }


def render(report: dict[str, Any]) -> str:
    results = report["results"]
    rows = []
    for res in results:
        for mode, m in res["modes"].items():
            rows.append(
                [
                    res["workload"],
                    res["world"],
                    res["precision"],
                    mode,
                    m["reference"] or "",
                    m["median_ms"],
                    m.get("ratio"),
                    interval(m.get("ratio_ci95")),
                    m.get("overhead_ms"),
                    m.get("own_overhead_ms"),
                    m["host_syncs_per_step"],
                ]
            )
    headers = ["workload", "world", "precision", "mode", "vs", "step ms", "ratio", "95% CI"]
    main = markdown_table([*headers, "+ms", "own +ms", "syncs/step"], rows)
    feature_rows = [
        [res["workload"], res["world"], res["precision"], feature, f["ratio"],
         interval(f["ratio_ci95"]), f["diff"]]
        for res in results
        for feature, f in res["features"].items()
    ]  # fmt: skip
    feature_table = markdown_table(
        ["workload", "world", "precision", "feature", "on / off", "95% CI", "+ms"], feature_rows
    )
    target_rows = [
        [t["workload"], t["world"], t["precision"], t["target"], t["value"],
         interval(t["ci95"]), f"<= {t['limit']}", t["verdict"]]
        for t in report["targets"]
    ]  # fmt: skip
    target_table = markdown_table(
        ["workload", "world", "precision", "target", "value", "95% CI", "limit", "verdict"],
        target_rows,
    )
    return "\n\n".join(
        [
            "Step time (median) and ratio to `vs` (median of the per-round ratios):",
            main,
            "What each feature costs (the guard with it over the guard without it):",
            feature_table,
            "Targets:",
            target_table,
        ]
    )


# -- command line -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> Settings:
    p = parser(__doc__, rounds=30, quick_rounds=3, warmup=3)
    p.add_argument("--workload", default="mlp,transformer", help="mlp, transformer, bnconv")
    p.add_argument("--world", default="1,2", help="1, 2 or 1,2")
    p.add_argument("--precision", default="fp32,bf16", help="fp32, bf16 (autocast) or both")
    p.add_argument(
        "--modes",
        default="core,features",
        help="modes or groups (core, features, all), comma-separated; references are added",
    )
    p.add_argument("--sizes", choices=("cpu", "gpu"), help="default: gpu on CUDA, else cpu")
    p.add_argument(
        "--threads", type=int, help="torch threads a process (default CPUs/world; 1 --quick)"
    )
    p.add_argument("--sync-steps", type=int, default=5, help="steps whose syncs are counted")
    args = p.parse_args(argv)
    finish_args(p, args, NAME)
    wanted: list[str] = []
    for item in _split(args.modes):
        wanted += GROUPS.get(item, [item])
    unknown = sorted(set(wanted) - set(MODES))
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    for mode in list(wanted):  # the references, and theirs
        ref = MODES[mode].reference
        while ref is not None:
            wanted.append(ref)
            ref = MODES[ref].reference
    bad = [w for w in _split(args.workload) if w not in ("mlp", "transformer", "bnconv")]
    if bad or any(p_ not in ("fp32", "bf16") for p_ in _split(args.precision)):
        p.error("--workload takes mlp, transformer, bnconv; --precision fp32, bf16")
    sizes = "quick" if args.quick else (args.sizes or ("gpu" if args.device == "cuda" else "cpu"))
    return Settings(
        workloads=tuple(_split(args.workload)),
        worlds=tuple(sorted({int(w) for w in _split(args.world)})),
        precisions=tuple(_split(args.precision)),
        modes=tuple(m for m in MODES if m in set(wanted)),
        rounds=args.rounds,
        warmup=args.warmup,
        sizes=sizes,
        device=args.device,
        seed=args.seed,
        threads=args.threads or (1 if args.quick else None),
        sync_steps=args.sync_steps if args.device == "cuda" else 0,
        extra={"out": str(args.out)},
    )


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    out = Path(settings.extra["out"])
    report = header(NAME, argv, {k: v for k, v in asdict(settings).items() if k != "extra"})
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tg-overhead-") as tmp:
        for world in settings.worlds:
            if world == 1:
                results += run_single(settings, Path(tmp))
            else:
                results += run_ddp(settings, world, Path(tmp))
    report["results"] = results
    report["targets"] = evaluate_targets(results)
    print(render(report))
    finish(report, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
