"""Spike rules on healthy and injected training runs: false positives and detections.

Each run trains one of the benchmark models (``overhead_modes``: the MLP stack and the small
GPT-style transformer, at small sizes) with AdamW, a linear warm-up then a cosine decay of
the learning rate, gradient clipping at 1.0 and noisy data. The real guard
(``tg.Guard(on_spike="warn")``, ``check()`` before the clip) judges every step live; the run
records the agreed loss and the pre-clip gradient norm. Every other rule is then judged on the
same recorded traces:

* ``trainguard (replayed)``: the default rule (``SpikeDetector``) replayed on the trace, a
  check that the trace is what the live guard saw;
* ``Megatron-LM spiky loss``: the max of the first 100 losses, then a loss >= 10x it;
* ``OLMo-core z-score``: a window of the previous 128 values (spikes included), judged once
  it holds 64; loss or gradient norm more than 6 standard deviations above the window mean;
* ``Lightning SpikeDetection``: running mean of the last 10 accepted losses (window 10,
  rtol 2, warmup 1); a loss that went up and is more than 2x the mean above it; a spike is
  not learned;
* ``ZClip z-score``: EMA (alpha 0.97) mean and variance of the gradient norm, initialised
  from the first 25 steps; z > 2.5 flags (ZClip clips there); the EMA learns the clipped value.

These are small reimplementations from the projects' documented rules (not their code).

Runs per workload and seed: one healthy run, and two runs with one bad batch at
``--inject-at``: ``targets_x20`` (MLP: targets x20; transformer: the batch's loss x20, token
targets cannot be scaled) and ``inputs_x20`` (MLP: inputs x20; transformer: token embeddings
x20); and one run with a lasting level change from ``--inject-at`` on, ``shift_x3`` (MLP:
targets x3; transformer: loss x3), which is not a spike: it shows how long each rule keeps
flagging a new level (under ``on_spike="skip"``, 3 flags in a row escalate). The data and the
initial weights depend on the seed only, so a run's trace equals the
healthy run's trace up to the injected step.

    .venv/bin/python benchmarks/spike_eval.py            # 5 seeds x 600 steps, ~minutes
    .venv/bin/python benchmarks/spike_eval.py --update-docs docs/spikes.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    load_average,
    machine_info,
    markdown_table,
    now_iso,
    replace_block,
    write_json,
)
from _gpt import TinyGPT
from overhead_modes import MLPStack
from torch import Tensor, nn

import trainguard as tg
from trainguard.step.spikes import SpikeDetector

INJECTIONS = ("none", "targets_x20", "inputs_x20", "shift_x3")
SPIKES = ("targets_x20", "inputs_x20")
"""One bad batch each; ``shift_x3`` is a lasting level change (every step from then on)."""
SIZES = {
    "mlp": {"width": 128, "layers": 4, "batch": 32},
    "transformer": {"vocab": 128, "dim": 64, "layers": 2, "heads": 4, "seq": 32, "batch": 16},
}
PEAK_LR = {"mlp": 1e-3, "transformer": 1e-3}
DELAY_WINDOW = 5
"""A detection counts when a rule flags the injected step or one of the next 4 steps."""


# -- the live runs ----------------------------------------------------------------------------


@dataclass
class Trace:
    workload: str
    seed: int
    injection: str
    inject_at: int | None
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    guard_spikes: list[int] = field(default_factory=list)
    """Steps with a ``spike`` event of the live guard."""
    seconds: float = 0.0


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_batches(workload: str, seed: int, steps: int) -> list[tuple[Tensor, Tensor]]:
    """Noisy data with something to learn: a fixed teacher plus noise (MLP); a noisy
    successor rule over tokens, 30% of the next tokens random (transformer)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    s = SIZES[workload]
    out = []
    if workload == "mlp":
        teacher = torch.randn(s["width"], s["width"], generator=gen) / math.sqrt(s["width"])
        for _ in range(steps):
            x = torch.randn(s["batch"], s["width"], generator=gen)
            noise = 0.3 * torch.randn(s["batch"], s["width"], generator=gen)
            out.append((x, torch.relu(x @ teacher) + noise))
        return out
    vocab, n = s["vocab"], s["seq"] + 1
    for _ in range(steps):
        tokens = torch.empty(s["batch"], n, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (s["batch"],), generator=gen)
        for t in range(1, n):
            rand = torch.randint(0, vocab, (s["batch"],), generator=gen)
            keep = torch.rand(s["batch"], generator=gen) > 0.3
            tokens[:, t] = torch.where(keep, (5 * tokens[:, t - 1] + 3) % vocab, rand)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def build(workload: str) -> nn.Module:
    s = SIZES[workload]
    if workload == "mlp":
        return MLPStack(s["width"], s["layers"])
    return TinyGPT(s["vocab"], s["dim"], s["layers"], s["heads"], s["seq"])


def step_loss(workload: str, model: nn.Module, batch: tuple[Tensor, Tensor], bad: str) -> Tensor:
    """The step's loss; ``bad``: the injection of this step ("none" for a healthy step)."""
    inputs, targets = batch
    if workload == "mlp":
        if bad == "targets_x20":
            targets = targets * 20.0
        if bad == "shift_x3":
            targets = targets * 3.0
        if bad == "inputs_x20":
            inputs = inputs * 20.0
        return F.mse_loss(model(inputs), targets)
    hook = None
    if bad == "inputs_x20":
        embedding: nn.Module = model.tok  # type: ignore[assignment]
        hook = embedding.register_forward_hook(lambda _m, _i, out: out * 20.0)
    try:
        logits = model(inputs)
    finally:
        if hook is not None:
            hook.remove()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return loss * {"targets_x20": 20.0, "shift_x3": 3.0}.get(bad, 1.0)


def _bad(injection: str, step: int, inject_at: int | None) -> str:
    if inject_at is None or step < inject_at:
        return "none"
    if step == inject_at or injection == "shift_x3":
        return injection
    return "none"


def run(workload: str, seed: int, injection: str, args: argparse.Namespace) -> Trace:
    inject_at = args.inject_at if injection != "none" else None
    trace = Trace(workload, seed, injection, inject_at)
    torch.manual_seed(seed)
    model = build(workload)
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK_LR[workload], weight_decay=0.01)
    warmup = args.steps // 10
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps, warmup))
    batches = make_batches(workload, seed, args.steps)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        config = tg.GuardConfig(run_dir=tmp, on_spike="warn", hang_timeout=0)
        guard = tg.Guard(model, opt, config=config)
        for step, batch in enumerate(guard.watch(batches)):
            loss = step_loss(workload, model, batch, _bad(injection, step, inject_at))
            loss.backward()
            ok = guard.check(loss)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # pre-clip norm
            trace.loss.append(float(loss.detach()))
            trace.grad_norm.append(float(norm))
            trace.lr.append(float(opt.param_groups[0]["lr"]))
            if ok:
                opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        guard.close()
        lines = (Path(tmp) / "events" / "rank-0.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    trace.guard_spikes = sorted({e["step"] for e in events if e["kind"] == "spike"})
    trace.seconds = time.perf_counter() - start
    return trace


# -- the rules, over a recorded trace -----------------------------------------------------------

Rule = Callable[[Trace], set[int]]


def trainguard_live(trace: Trace) -> set[int]:
    return set(trace.guard_spikes)


def trainguard_replayed(trace: Trace) -> set[int]:
    det = SpikeDetector()
    flagged = set()
    for i, (loss, norm, lr) in enumerate(zip(trace.loss, trace.grad_norm, trace.lr, strict=True)):
        if det.observe({"loss": loss, "grad_norm": norm}, lr):
            flagged.add(i)
    return flagged


def megatron(trace: Trace, samples: int = 100, threshold: float = 10.0) -> set[int]:
    """Max |loss| of the first ``samples`` values, then a loss >= threshold x that max."""
    ceiling = max(abs(v) for v in trace.loss[:samples])
    return {i for i, v in enumerate(trace.loss) if i >= samples and abs(v) >= threshold * ceiling}


def _window_flags(values: list[float], window: int, sigmas: float) -> set[int]:
    flagged = set()
    for i in range(max(2, window // 2), len(values)):
        past = values[max(0, i - window) : i]  # every past value, spikes included
        mean, std = statistics.fmean(past), statistics.stdev(past)
        if values[i] - mean > sigmas * std:
            flagged.add(i)
    return flagged


def olmo_core(trace: Trace, window: int = 128, sigmas: float = 6.0) -> set[int]:
    """Loss or gradient norm > mean + 6 std of the previous 128 values (judged from 64)."""
    return _window_flags(trace.loss, window, sigmas) | _window_flags(
        trace.grad_norm, window, sigmas
    )


def lightning(trace: Trace, window: int = 10, rtol: float = 2.0, warmup: int = 1) -> set[int]:
    """Loss went up and is more than rtol x the running mean (last ``window`` accepted)."""
    accepted: list[float] = []
    last = 0.0
    flagged = set()
    for i, v in enumerate(trace.loss):
        mean = statistics.fmean(accepted[-window:]) if accepted else 0.0
        if i >= warmup and v - last > 0 and abs(v - mean) >= abs(rtol * mean):
            flagged.add(i)  # Lightning raises here; the spike is not learned
            continue
        accepted.append(v)
        last = v
    return flagged


def zclip(trace: Trace, alpha: float = 0.97, z_max: float = 2.5, warmup: int = 25) -> set[int]:
    """EMA z-score of the gradient norm; the clipped value updates the EMA."""
    norms = trace.grad_norm
    mean = statistics.fmean(norms[:warmup])
    var = statistics.pvariance(norms[:warmup])
    flagged = set()
    for i in range(warmup, len(norms)):
        g, std = norms[i], math.sqrt(var)
        z = (g - mean) / std if std > 0 else 0.0
        if z > z_max:
            flagged.add(i)
            g = mean + (z_max**2 / z) * std  # ZClip's reciprocal clip
        mean = alpha * mean + (1 - alpha) * g
        var = alpha * var + (1 - alpha) * (g - mean) ** 2
    return flagged


RULES: dict[str, Rule] = {
    "trainguard (live Guard, default rule)": trainguard_live,
    "trainguard (replayed on the trace)": trainguard_replayed,
    "Megatron-LM spiky loss (10x max of first 100)": megatron,
    "OLMo-core z-score (128 steps, 6 sigma)": olmo_core,
    "Lightning SpikeDetection (window 10, rtol 2)": lightning,
    "ZClip z-score of grad norm (alpha 0.97, z 2.5)": zclip,
}


# -- scoring ------------------------------------------------------------------------------------


def score(traces: list[Trace], rule: Rule) -> dict[str, Any]:
    healthy = [t for t in traces if t.inject_at is None]
    fp = [len(rule(t)) for t in healthy]
    out: dict[str, Any] = {
        "healthy_runs": len(healthy),
        "healthy_steps": sum(len(t.loss) for t in healthy),
        "false_positives": sum(fp),
        "runs_with_false_positives": sum(1 for n in fp if n),
    }
    for kind in SPIKES:
        runs = [t for t in traces if t.injection == kind]
        delays, after = [], 0
        for t in runs:
            assert t.inject_at is not None
            flagged = rule(t)
            hits = sorted(s - t.inject_at for s in flagged if 0 <= s - t.inject_at < DELAY_WINDOW)
            if hits:
                delays.append(hits[0])
            after += sum(1 for s in flagged if s > t.inject_at + DELAY_WINDOW - 1)
        out[kind] = {
            "runs": len(runs),
            "on_step": sum(1 for d in delays if d == 0),
            "within_window": len(delays),
            "delays": delays,
            "flags_after": after,
        }
    out["shift_x3"] = score_shift([t for t in traces if t.injection == "shift_x3"], rule)
    return out


def score_shift(runs: list[Trace], rule: Rule) -> dict[str, Any]:
    """A lasting level change: flagged at the change? how many flags, how many in a row?"""
    on_step, flags, longest = 0, 0, 0
    for t in runs:
        start = t.inject_at if t.inject_at is not None else 0
        flagged = {s for s in rule(t) if s >= start}
        on_step += start in flagged
        flags += len(flagged)
        run_length = 0
        for step in range(start, len(t.loss)):
            run_length = run_length + 1 if step in flagged else 0
            longest = max(longest, run_length)
    return {"runs": len(runs), "on_step": on_step, "flags": flags, "longest_run": longest}


def spike_size(traces: list[Trace]) -> dict[str, dict[str, float]]:
    """Median over runs of value at the injected step / median of the 20 steps before."""
    sizes: dict[str, dict[str, float]] = {}
    for kind in INJECTIONS[1:]:
        for workload in SIZES:
            runs = [t for t in traces if t.injection == kind and t.workload == workload]
            if not runs:
                continue
            ratios: dict[str, list[float]] = {"loss": [], "grad_norm": []}
            for t in runs:
                assert t.inject_at is not None
                for metric, values in (("loss", t.loss), ("grad_norm", t.grad_norm)):
                    before = statistics.median(values[t.inject_at - 20 : t.inject_at])
                    ratios[metric].append(values[t.inject_at] / before)
            sizes[f"{workload}/{kind}"] = {m: statistics.median(v) for m, v in ratios.items()}
    return sizes


def table(results: dict[str, dict[str, Any]]) -> str:
    headers = [
        "rule",
        "false positives (healthy steps)",
        "runs with a false positive",
        "targets x20: on the step",
        "targets x20: delay",
        "inputs x20: on the step",
        "inputs x20: delay",
        "flags after the injection",
    ]
    rows = []
    for name, r in results.items():
        row: list[object] = [
            name,
            f"{r['false_positives']} / {r['healthy_steps']}",
            f"{r['runs_with_false_positives']} / {r['healthy_runs']}",
        ]
        for kind in SPIKES:
            k = r[kind]
            row.append(f"{k['on_step']} / {k['runs']}")
            row.append(_delays(k["delays"], k["runs"]))
        row.append(sum(r[k]["flags_after"] for k in SPIKES))
        rows.append(row)
    return markdown_table(headers, rows)


def shift_table(results: dict[str, dict[str, Any]]) -> str:
    headers = [
        "rule",
        "flagged at the change",
        "flags from the change on",
        "longest run of consecutive flags",
    ]
    rows: list[list[object]] = []
    for name, r in results.items():
        k = r["shift_x3"]
        rows.append([name, f"{k['on_step']} / {k['runs']}", k["flags"], k["longest_run"]])
    return markdown_table(headers, rows)


def _delays(delays: list[int], runs: int) -> str:
    if not delays:
        return "missed"
    missed = runs - len(delays)
    text = f"{statistics.median(delays):g} steps (max {max(delays)})"
    return text + (f", {missed} missed" if missed else "")


def size_table(sizes: dict[str, dict[str, float]]) -> str:
    rows = [[k, v["loss"], v["grad_norm"]] for k, v in sizes.items()]
    return markdown_table(["run / injection", "loss ratio", "grad-norm ratio"], rows)


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--inject-at", type=int, default=300)
    p.add_argument("--workloads", default="mlp,transformer")
    p.add_argument("--threads", type=int, default=1, help="torch threads (shared machine: 1)")
    p.add_argument("--out", type=Path, default=Path("runs/benchmarks/spike_eval.json"))
    p.add_argument("--from-json", type=Path, help="render a saved report; run nothing")
    p.add_argument("--update-docs", type=Path, help="replace the spike-eval block of this page")
    args = p.parse_args(argv)
    if args.from_json is None and not (DELAY_WINDOW + 20 <= args.inject_at < args.steps - 10):
        p.error(f"--inject-at must lie in [{DELAY_WINDOW + 20}, --steps - 10)")
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    traces: list[Trace] = []
    for workload in args.workloads.split(","):
        for seed in range(args.seeds):
            for injection in INJECTIONS:
                trace = run(workload, seed, injection, args)
                traces.append(trace)
                print(
                    f"{workload} seed {seed} {injection}: {len(trace.loss)} steps in "
                    f"{trace.seconds:.1f}s, guard spikes at {trace.guard_spikes}",
                    file=sys.stderr,
                )
    results = {name: score(traces, rule) for name, rule in RULES.items()}
    per_workload = {
        w: {name: score([t for t in traces if t.workload == w], r) for name, r in RULES.items()}
        for w in args.workloads.split(",")
    }
    return {
        "benchmark": "spike_eval",
        "time": now_iso(),
        "command": " ".join(["python", *sys.argv]),
        "machine": machine_info(),
        "load_average_after": load_average(),
        "config": {
            "seeds": args.seeds,
            "workloads": args.workloads.split(","),
            "steps": args.steps,
            "inject_at": args.inject_at,
            "warmup_steps": args.steps // 10,
            "sizes": SIZES,
            "peak_lr": PEAK_LR,
            "grad_clip": 1.0,
            "delay_window": DELAY_WINDOW,
        },
        "results": results,
        "per_workload": per_workload,
        "spike_size": spike_size(traces),
        "traces": [t.__dict__ for t in traces],
    }


def render(report: dict[str, Any]) -> str:
    m, c = report["machine"], report["config"]
    lines = [
        f"{c['seeds']} seeds x {len(c['workloads'])} workloads, {c['steps']} steps per run, "
        f"warm-up {c['warmup_steps']} steps then cosine decay, injection at step "
        f"{c['inject_at']}; a detection is a flag within {c['delay_window']} steps of it.",
        "",
        table(report["results"]),
        "",
        "A lasting level change (`shift_x3`, not a spike; summed over the runs):",
        "",
        shift_table(report["results"]),
        "",
        "Size of the injected spikes (value at the step / median of the 20 steps before, "
        "median over seeds):",
        "",
        size_table(report["spike_size"]),
        "",
        f"Measured {report['time']} on {m['cpu']} ({m['cpus_available']} CPUs available, "
        f"torch {m['torch']}, {m['torch_threads']} torch thread), load average "
        f"{m['load_average']} (a shared machine; the tables count events, not times).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text(encoding="utf-8"))
    else:
        report = measure(args)
        write_json(args.out, report)
        print(f"wrote {args.out}", file=sys.stderr)
    text = render(report)
    print(text)
    for workload, results in report["per_workload"].items():
        print(f"\n{workload}:\n\n{table(results)}")
    if args.update_docs is not None:
        replace_block(args.update_docs, "spike-eval", text)


if __name__ == "__main__":
    main()
