"""What each GPU-relevant feature of the guard costs on a GPU-bound step (issue 28).

    python benchmarks/gpu_features.py [--rounds 10] [--out runs/benchmarks/gpu_features.json]
    python benchmarks/gpu_features.py --device cpu --quick      # smoke test, seconds
    python benchmarks/gpu_features.py --from-json A.json B.json  # the table of saved runs

1. A GPT-style transformer (``_gpt.TinyGPT``) whose batch is picked so that a bare fused
   step takes about ``--target-ms`` (default 30 ms), in float32 and under bf16 autocast.
   The modes (``MODES``) train copies of the same model on the same batches, interleaved
   block by block in a shuffled order each round: a block is ``--block-steps`` steps timed
   from a ``synchronize()`` to a ``synchronize()``. Each mode is compared with its reference
   by the median of the per-round ratios (and quartiles), and the median paired difference.
   The batch carries a float loss-weight mask beside the tokens, so that the input check has
   a floating-point tensor to check (token ids are integers, which it skips).
2. Buffer restore on a BatchNorm conv net (its forward writes the running statistics every
   step), with the input check on its float images: small (launch-bound, a few ms a step)
   and large (GPU-bound, about 13 ms a step on an H100).
3. Host syncs per step (``torch.cuda.set_sync_debug_mode("warn")``) over the whole loop
   iteration, fetch from ``watch()`` included, for every guard mode; where a mode syncs, the
   Python stacks of the syncs (the first frames inside trainguard) say which part it is.
4. ``autocast_state()``, the step-start hook's read of the autocast state, in microseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import random
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bnconv import BNConv
from _common import machine_info, markdown_table, median, now_iso, quartiles, write_json
from _gpt import TinyGPT

import trainguard as tg
from trainguard.health.timing import StepTimer
from trainguard.step.start import autocast_state

MINIMAL: dict[str, Any] = {
    "on_spike": "off",
    "check_inputs": False,
    "detect_stragglers": False,
    "restore_buffers": False,
    "replica_check_every": 0,
}
"""The guard with every optional per-step feature off (the NaN/Inf check, capture stay)."""


@dataclass(frozen=True)
class ModeSpec:
    what: str
    ref: str | None = "bare_fused"
    fused: bool = True
    guard: dict[str, Any] | None = None
    """GuardConfig options (None: no guard)."""
    call: str = "step"
    """``step`` (guard.step) or ``check`` (if guard.check(loss): opt.step())."""
    extra: str = ""
    """``timing_hooks`` or ``nancapture`` for the two guard-free comparisons."""


def _specs(every: int) -> dict[str, ModeSpec]:
    return {
        "bare": ModeSpec("bare loop, AdamW (foreach)", ref=None, fused=False),
        "bare_fused": ModeSpec("bare loop, AdamW(fused=True)", ref=None),
        "check": ModeSpec(
            "Guard defaults, if guard.check(loss): opt.step()", guard={}, call="check"
        ),
        "step": ModeSpec("Guard defaults, guard.step(loss): sync-free", guard={}),
        "step_all": ModeSpec(
            "defaults + on_spike='skip' (the device spike rule): every per-step feature",
            guard={"on_spike": "skip"},
        ),
        "step_min": ModeSpec("minimal guard (spike, inputs, timing, restore off)", guard=MINIMAL),
        "min+spike_warn": ModeSpec(
            "minimal + on_spike='warn' (host rule, a step late)",
            guard={**MINIMAL, "on_spike": "warn"},
        ),
        "min+spike_skip": ModeSpec(
            "minimal + on_spike='skip' (device rule)", guard={**MINIMAL, "on_spike": "skip"}
        ),
        "min+inputs": ModeSpec(
            "minimal + check_inputs (on the device)", guard={**MINIMAL, "check_inputs": True}
        ),
        "min+timing": ModeSpec(
            "minimal + detect_stragglers (per-rank timing; one process: no module hook)",
            guard={**MINIMAL, "detect_stragglers": True},
        ),
        "min+restore": ModeSpec(
            "minimal + restore_buffers", guard={**MINIMAL, "restore_buffers": True}
        ),
        "check_min": ModeSpec(
            "minimal guard with check() (the path recovery forces)", guard=MINIMAL, call="check"
        ),
        "min+snapshots": ModeSpec(
            f"minimal + on_escalation='rollback', snapshot_every={every} (CPU snapshot; "
            "recovery makes step() take the check() path)",
            ref="check_min",
            guard={**MINIMAL, "on_escalation": "rollback", "snapshot_every": every},
        ),
        "min+checkpoints": ModeSpec(
            f"minimal + checkpoint_every={every} (DCP to local disk; check() path)",
            ref="check_min",
            guard={**MINIMAL, "checkpoint_every": every, "snapshot_every": 0},
        ),
        "timing_hooks": ModeSpec(
            "bare_fused + StepTimer's forward hooks (the multi-rank timing path)",
            extra="timing_hooks",
        ),
        "nancapture": ModeSpec(
            "NaNCapture-style callback: deepcopy(batch) + RNG snapshot, a forward hook on "
            "every leaf module checking its output (bool(isfinite(out).all()): a sync each)",
            extra="nancapture",
        ),
    }


TRANSFORMER_MODES = (
    "bare",
    "bare_fused",
    "check",
    "step",
    "step_all",
    "step_min",
    "min+spike_warn",
    "min+spike_skip",
    "min+inputs",
    "min+timing",
    "check_min",
    "min+snapshots",
    "min+checkpoints",
    "timing_hooks",
    "nancapture",
)
BNCONV_MODES = ("bare_fused", "step_min", "min+restore", "min+inputs", "step", "check")


# -- workloads --------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    build: Callable[[], nn.Module]
    batches: list[tuple[Tensor, ...]]
    loss: Callable[[nn.Module, tuple[Tensor, ...]], Tensor]
    autocast: torch.dtype | None
    device: torch.device
    what: str
    info: dict[str, Any] = field(default_factory=dict)
    initial: nn.Module | None = None

    def model(self) -> nn.Module:
        if self.initial is None:
            torch.manual_seed(0)
            self.initial = self.build().to(self.device)
        return copy.deepcopy(self.initial)

    def context(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)


GPT = {"vocab": 8192, "dim": 768, "layers": 6, "heads": 12, "seq": 512}
GPT_QUICK = {"vocab": 64, "dim": 32, "layers": 1, "heads": 2, "seq": 16}


def _gpt_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    tokens, targets, weights = batch
    logits = model(tokens)
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return (per_token * weights.flatten()).mean()


def transformer(
    device: torch.device, autocast: torch.dtype | None, batch: int, quick: bool
) -> Workload:
    cfg = GPT_QUICK if quick else GPT
    gen = torch.Generator().manual_seed(0)
    batches: list[tuple[Tensor, ...]] = []
    for _ in range(4):
        tokens = torch.randint(0, cfg["vocab"], (batch, cfg["seq"] + 1), generator=gen)
        weights = torch.rand(batch, cfg["seq"], generator=gen) + 0.5
        batches.append(tuple(t.to(device) for t in (tokens[:, :-1], tokens[:, 1:], weights)))
    precision = "bf16 autocast" if autocast is not None else "float32"
    what = (
        f"TinyGPT vocab {cfg['vocab']}, dim {cfg['dim']}, {cfg['layers']} layers, "
        f"{cfg['heads']} heads, seq {cfg['seq']}, batch {batch}, {precision}, AdamW"
    )
    return Workload(
        "transformer",
        lambda: TinyGPT(cfg["vocab"], cfg["dim"], cfg["layers"], cfg["heads"], cfg["seq"]),
        batches,
        _gpt_loss,
        autocast,
        device,
        what,
        {**cfg, "batch": batch, "precision": precision},
    )


def bnconv(device: torch.device, quick: bool, large: bool = False) -> Workload:
    """``large``: sized to keep the GPU busy (about 13 ms a step on an H100); else a small,
    launch-bound net (a few ms), where the guard's fixed host cost shows."""
    width, size, batch = (4, 8, 4) if quick else (128, 64, 128) if large else (64, 32, 128)
    gen = torch.Generator().manual_seed(0)
    batches: list[tuple[Tensor, ...]] = [
        tuple(
            t.to(device)
            for t in (
                torch.randn(batch, 3, size, size, generator=gen),
                torch.randint(0, 10, (batch,)),
            )
        )
        for _ in range(4)
    ]
    return Workload(
        "bnconv_large" if large else "bnconv",
        lambda: BNConv(width),
        batches,
        lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        None,
        device,
        f"3 x (Conv2d({width}) + BatchNorm2d + ReLU), images {batch} x 3 x {size} x {size}, "
        "float32, AdamW",
        {"width": width, "size": size, "batch": batch},
    )


# -- one mode ---------------------------------------------------------------------------------


class Mode:
    """One way of training a copy of the workload's model; ``step()`` runs one step."""

    def __init__(self, name: str, spec: ModeSpec, work: Workload, run_dir: str) -> None:
        self.name, self.spec, self.work = name, spec, work
        self.model = work.model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=spec.fused)
        self.guard: tg.Guard | None = None
        self.i = 0
        self._hooks: list[Any] = []
        self.timer: StepTimer | None = None
        self.bad_modules = 0
        if spec.guard is not None:
            config = tg.GuardConfig(run_dir=run_dir, hang_timeout=0, **spec.guard)
            self.guard = tg.Guard(self.model, self.opt, config=config)
            self.stream: Iterator[Any] = iter(self.guard.watch(itertools.cycle(work.batches)))
        elif spec.extra == "timing_hooks":
            self.timer = StepTimer(self.model, forward_hooks=True)
        elif spec.extra == "nancapture":
            for module in self.model.modules():
                if not list(module.children()):
                    self._hooks.append(module.register_forward_hook(self._check_output))

    def _check_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, Tensor) and not bool(torch.isfinite(output).all()):
            self.bad_modules += 1

    def fetch(self) -> tuple[Tensor, ...]:
        if self.guard is not None:
            batch: tuple[Tensor, ...] = next(self.stream)
            return batch
        batch = self.work.batches[self.i % len(self.work.batches)]
        self.i += 1
        if self.spec.extra == "nancapture":
            self.saved = (copy.deepcopy(batch), torch.get_rng_state(), random.getstate())
        return batch

    def train(self, batch: tuple[Tensor, ...]) -> None:
        with self.work.context():
            loss = self.work.loss(self.model, batch)
        loss.backward()
        if self.guard is not None and self.spec.call == "step":
            self.guard.step(loss)
            return
        if self.guard is None or self.guard.check(loss):
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.timer is not None:
            self.timer.take()

    def step(self) -> None:
        self.train(self.fetch())

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
        if self.timer is not None:
            self.timer.close()
        for handle in self._hooks:
            handle.remove()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(
    work: Workload,
    names: tuple[str, ...],
    specs: dict[str, ModeSpec],
    rounds: int,
    block_steps: int,
    warmup: int,
    deadline: float,
    run_dir: str,
) -> dict[str, Any]:
    """Blocks of ``block_steps`` steps per mode, shuffled order each round, medians and paired
    ratios. Stops early (fewer rounds, said in the result) when ``deadline`` would pass. A
    mode that raises is dropped from the rounds after and its error reported."""
    errors: dict[str, str] = {}
    modes: dict[str, Mode] = {}
    for n in names:
        try:
            modes[n] = Mode(n, specs[n], work, f"{run_dir}/{work.name}-{n}")
        except Exception as exc:
            errors[n] = f"set-up: {type(exc).__name__}: {exc}"
    times: dict[str, list[float]] = {n: [] for n in names}
    started = time.monotonic()
    done = 0
    for r in range(-warmup, rounds):
        order = [n for n in names if n in modes and n not in errors]
        random.Random(r).shuffle(order)
        round_start = time.monotonic()
        for name in order:
            _sync(work.device)
            t0 = time.perf_counter()
            try:
                for _ in range(block_steps):
                    modes[name].step()
                _sync(work.device)
            except Exception as exc:
                errors[name] = f"round {r}: {type(exc).__name__}: {exc}"
                print(f"  {name} failed: {errors[name]}", flush=True)
                continue
            if r >= 0:
                times[name].append(1e3 * (time.perf_counter() - t0) / block_steps)
        done = max(done, r + 1)
        if time.monotonic() + (time.monotonic() - round_start) > deadline:
            break
    for name, mode in modes.items():
        try:
            mode.close()
        except Exception as exc:
            errors.setdefault(name, f"close: {type(exc).__name__}: {exc}")
    out: dict[str, Any] = {
        "workload": work.what,
        "info": work.info,
        "rounds": done,
        "rounds_asked": rounds,
        "block_steps": block_steps,
        "seconds": time.monotonic() - started,
        "modes": {},
        "errors": errors,
    }
    for name in names:
        if name in errors or not times[name]:
            out["modes"][name] = {"what": specs[name].what, "step_ms": None, "samples_ms": []}
            continue
        row: dict[str, Any] = {"what": specs[name].what, "step_ms": median(times[name])}
        ref = specs[name].ref
        if ref is not None and len(times.get(ref, [])) == len(times[name]):
            ratios = [t / b for t, b in zip(times[name], times[ref], strict=True)]
            p25, p75 = quartiles(ratios)
            diffs = [t - b for t, b in zip(times[name], times[ref], strict=True)]
            row |= {"reference": ref, "ratio": median(ratios), "ratio_p25": p25}
            row |= {"ratio_p75": p75, "overhead_ms": median(diffs)}
        row["samples_ms"] = times[name]
        if name == "nancapture":
            row["bad_modules_seen"] = modes[name].bad_modules
        out["modes"][name] = row
    return out


def pick_batch(device: torch.device, autocast: torch.dtype | None, target_ms: float) -> int:
    """The smallest batch whose bare fused step takes at least ``target_ms``."""
    spec = _specs(10)["bare_fused"]
    best = 2
    for batch in (2, 4, 8, 16, 32, 64, 128):
        work = transformer(device, autocast, batch, quick=False)
        mode = Mode("bare_fused", spec, work, "")
        for _ in range(3):
            mode.step()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(5):
            mode.step()
        _sync(device)
        ms = 1e3 * (time.perf_counter() - t0) / 5
        print(f"  batch {batch}: {ms:.1f} ms", flush=True)
        best = batch
        del mode, work
        if ms >= target_ms:
            break
    return best


# -- host syncs per step ----------------------------------------------------------------------


def _sync_stack(frames: list[traceback.FrameSummary]) -> str:
    """The frames that say where a sync comes from: the innermost (the op), then those
    inside trainguard and this script, innermost first."""
    frames = [f for f in frames if not f.filename.endswith("warnings.py")]
    keep = [f for f in frames if "trainguard" in f.filename or "gpu_features" in f.filename]
    if frames and (not keep or keep[-1] is not frames[-1]):
        keep.append(frames[-1])
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(keep))


def count_syncs(
    work: Workload, names: tuple[str, ...], specs: dict[str, ModeSpec], steps: int, run_dir: str
) -> dict[str, Any]:
    """Syncs PyTorch reports per loop iteration (fetch, forward, backward, check/step)."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = _count_mode(work, name, specs[name], steps, run_dir)
        except Exception as exc:
            torch.cuda.set_sync_debug_mode("default")
            out[name] = {"per_step": [], "stacks": {}, "error": f"{type(exc).__name__}: {exc}"}
        print(f"  {name}: {out[name]['per_step']} {out[name].get('error', '')}", flush=True)
    return out


def _count_mode(
    work: Workload, name: str, spec: ModeSpec, steps: int, run_dir: str
) -> dict[str, Any]:
    """Syncs of each of ``steps`` loop iterations of one mode, and their stacks."""
    mode = Mode(name, spec, work, f"{run_dir}/{work.name}-syncs-{name}")
    counts: list[int] = []
    stacks: dict[str, int] = {}
    for _ in range(steps):
        caught: list[str] = []

        def _record(message: Any, *args: Any, caught: list[str] = caught, **kw: Any) -> None:
            if "synchroniz" in str(message):  # not the other warnings (DCP's, say)
                caught.append(_sync_stack(traceback.extract_stack()[:-1]))

        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = _record
                mode.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts.append(len(caught))
        for stack in caught:
            stacks[stack] = stacks.get(stack, 0) + 1
    _sync(work.device)
    mode.close()
    return {"per_step": counts, "stacks": stacks}


# -- report -----------------------------------------------------------------------------------


def table(sections: list[tuple[str, dict[str, Any]]], syncs: dict[str, Any]) -> str:
    rows = []
    for label, res in sections:
        for name, row in res["modes"].items():
            per_step = syncs.get(label, {}).get(name, {}).get("per_step")
            rows.append(
                [
                    label,
                    name,
                    row["step_ms"],
                    row.get("reference", ""),
                    row.get("ratio"),
                    row.get("ratio_p25"),
                    row.get("ratio_p75"),
                    row.get("overhead_ms"),
                    median(per_step[1:]) if per_step and len(per_step) > 1 else None,
                ]
            )
    headers = ("run", "mode", "step ms", "vs", "ratio", "p25", "p75", "+ms", "syncs/step")
    return markdown_table(headers, rows)


def saved_table(paths: list[Path]) -> str:
    """The table of saved reports, a run measured in several named by its report (``#2``)."""
    reports = [json.loads(path.read_text(encoding="utf-8")) for path in paths]
    labels = [label for report in reports for label in report["runs"]]
    sections: list[tuple[str, dict[str, Any]]] = []
    syncs: dict[str, Any] = {}
    for i, report in enumerate(reports, 1):
        for label, res in report["runs"].items():
            name = label if labels.count(label) == 1 else f"{label} #{i}"
            if "modes" in res:
                sections.append((name, res))
            syncs[name] = report["sync_counts"].get(label, {})
    return table(sections, syncs)


def gpu_info() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {}
    info: dict[str, Any] = {
        "name": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
        info["driver"] = subprocess.run(
            query, capture_output=True, text=True, timeout=20
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        info["driver"] = f"unknown ({exc})"
    return info


def autocast_cost(device: torch.device, repeats: int) -> dict[str, float]:
    """Microseconds per ``autocast_state()`` call, outside and inside bf16 autocast."""
    out = {}
    for label, ctx in (
        ("off", contextlib.nullcontext()),
        ("bf16", torch.autocast(device.type, dtype=torch.bfloat16)),
    ):
        with ctx:
            t0 = time.perf_counter()
            for _ in range(repeats):
                autocast_state(device.type)
            out[f"autocast_state_us_{label}"] = 1e6 * (time.perf_counter() - t0) / repeats
    return out


def _workload(
    label: str, dtype: torch.dtype | None, device: torch.device, args: argparse.Namespace
) -> Workload:
    if label.startswith("bnconv"):
        return bnconv(device, args.quick, large=label == "bnconv_large")
    batch = 2
    if not args.quick and device.type == "cuda":
        print(f"[{label}] picking the batch (bare fused step >= {args.target_ms} ms)")
        batch = pick_batch(device, dtype, args.target_ms)
    return transformer(device, dtype, batch, args.quick)


RUNS: dict[str, tuple[torch.dtype | None, float]] = {
    "fp32": (None, 0.36),
    "bf16": (torch.bfloat16, 0.34),
    "bnconv": (None, 0.12),
    "bnconv_large": (None, 0.18),
}
"""Each run: the autocast dtype, and its share of the timing budget."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--target-ms", type=float, default=30.0, help="bare fused step time")
    parser.add_argument("--sync-steps", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=330.0, help="stop rounds before")
    parser.add_argument("--runs", default=",".join(RUNS), help="which of " + ", ".join(RUNS))
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks/gpu_features.json"))
    parser.add_argument("--modes", help="only these modes (comma-separated; default: all)")
    parser.add_argument("--from-json", type=Path, nargs="+", help="print the saved runs' table")
    args = parser.parse_args(argv)
    if args.from_json:
        print(saved_table(args.from_json))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_features: no CUDA device here; use --device cpu for a smoke run")
        return 2
    if args.quick:
        args.rounds, args.warmup, args.block_steps = min(args.rounds, 2), 1, 2
    start = time.monotonic()
    specs = _specs(args.block_steps)
    report: dict[str, Any] = {
        "benchmark": "gpu_features",
        "date": now_iso(),
        "command": " ".join(["python", *sys.argv]),
        "machine": machine_info(),
        "gpu": gpu_info(),
        "modes": {name: spec.what for name, spec in specs.items()},
        "runs": {},
        "sync_counts": {},
    }
    sections: list[tuple[str, dict[str, Any]]] = []
    runs = [r for r in RUNS if r in args.runs.split(",")]
    weight = sum(RUNS[r][1] for r in runs)
    budget = args.budget_s - 60 if not args.quick else args.budget_s  # the sync counts after
    with tempfile.TemporaryDirectory() as tmp:
        for label in runs:
            try:
                work = _workload(label, RUNS[label][0], device, args)
                print(f"[{label}] {work.what}", flush=True)
                names: tuple[str, ...] = (
                    BNCONV_MODES if label.startswith("bnconv") else TRANSFORMER_MODES
                )
                if args.modes:
                    names = tuple(n for n in names if n in args.modes.split(","))
                deadline = time.monotonic() + RUNS[label][1] / weight * budget
                res = interleaved(
                    work, names, specs, args.rounds, args.block_steps, args.warmup, deadline, tmp
                )
                report["runs"][label] = res
                sections.append((label, res))
                if device.type == "cuda":
                    print(f"[{label}] syncs per step", flush=True)
                    report["sync_counts"][label] = count_syncs(
                        work, names, specs, args.sync_steps, tmp
                    )
            except Exception as exc:
                traceback.print_exc()
                report["runs"][label] = {"error": f"{type(exc).__name__}: {exc}"}
            work = None  # type: ignore[assignment]
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report["autocast_state"] = autocast_cost(device, 200 if args.quick else 20000)
    report["seconds"] = time.monotonic() - start
    write_json(args.out, report)
    print(f"\n{report['machine']['gpu'] or 'cpu'}, torch {torch.__version__}, {report['gpu']}")
    for label, res in sections:
        print(f"- {label}: {res['workload']}; {res['rounds']} rounds of {res['block_steps']} steps")
        for name, error in res["errors"].items():
            print(f"  {name} FAILED: {error}")
    print(table(sections, report["sync_counts"]))
    for label, per_mode in report["sync_counts"].items():
        for name, found in per_mode.items():
            for stack, n in found["stacks"].items():
                print(f"sync [{label} {name}] x{n}: {stack}")
    print(f"autocast_state(): {report['autocast_state']}")
    print(f"\nJSON: {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
