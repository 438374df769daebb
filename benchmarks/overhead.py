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

This file is the command line and the orchestration; the parts: ``overhead_modes`` (the
workloads and the modes), ``overhead_measure`` (interleaved rounds, per-mode summaries, the
DDP processes) and ``overhead_report`` (targets, bootstrap intervals, verdicts, tables, the
text of a report, ``--from-json``).
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine_info, now_iso, replace_block, write_json
from overhead_measure import Settings, run_ddp, run_single, threads_for
from overhead_modes import MODES, workloads
from overhead_report import evaluate_targets, load_report, render, render_targets_of_runs

DOCS_BLOCK = "overhead-results"


# -- command line -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _add_what_runs(parser.add_argument_group("what runs"))
    _add_how_it_runs(parser.add_argument_group("how it runs"))
    _add_output(parser.add_argument_group("output"))
    args = parser.parse_args(argv)
    settings = _settings(args)
    if settings.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if settings.rounds < 1 or settings.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    return settings, args


def _add_what_runs(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--workload", choices=("mlp", "transformer", "all"), default="all")
    group.add_argument("--world", choices=("1", "2", "all"), default="all")
    group.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    group.add_argument(
        "--sizes",
        choices=("cpu", "gpu"),
        default="cpu",
        help="workload sizes: cpu (a step of 0.1-1 s on 2 cores) or gpu (tens of ms on an H100)",
    )
    group.add_argument("--modes", help=f"comma-separated subset of: {', '.join(MODES)}")
    group.add_argument(
        "--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu"
    )


def _add_how_it_runs(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--rounds", type=int, help="timed rounds (default 30; 3 with --quick)")
    group.add_argument("--warmup", type=int, help="untimed rounds first (default 3; 1 --quick)")
    group.add_argument(
        "--slow-every", type=int, default=1, help="run detect_anomaly every N-th round only"
    )
    group.add_argument("--max-norm", type=float, help="clip norm (default: per workload)")
    group.add_argument(
        "--threads", type=int, help="torch threads per process (default: CPUs/world)"
    )
    group.add_argument("--seed", type=int, default=0)


def _add_output(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--out", type=Path, default=Path("runs/benchmarks/overhead.json"))
    group.add_argument("--update-docs", type=Path, metavar="PAGE", help="e.g. docs/benchmarks.md")
    group.add_argument(
        "--docs-block",
        default=DOCS_BLOCK,
        help=f"the marked block of PAGE to replace (default {DOCS_BLOCK})",
    )
    group.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="measure nothing: render a report written earlier (e.g. on a GPU machine); "
        "with several files, one table of every target they measured",
    )


def _settings(args: argparse.Namespace) -> Settings:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return Settings(
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
        reports = [load_report(path) for path in args.from_json]
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
