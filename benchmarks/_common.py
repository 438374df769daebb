"""What every benchmark shares: the command line, the report's header and JSON, interleaved
rounds, paired statistics (ratios, bootstrap intervals), markdown tables, processes.

Not a package module: the benchmark scripts import it from their own folder.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

import trainguard

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
T = TypeVar("T")

# -- the command line ---------------------------------------------------------------------------


def parser(
    doc: str | None, rounds: int, quick_rounds: int, warmup: int = 2, device: bool = True
) -> argparse.ArgumentParser:
    """The options every benchmark takes; a script adds its own to the parser returned.
    ``device``: whether ``--device`` is offered (without it the run is on the CPU)."""
    p = argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0],
        epilog="\n\n".join((doc or "").split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, few rounds: a smoke run")
    if device:
        p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    else:
        p.set_defaults(device="cpu")
    p.add_argument(
        "--rounds", type=int, help=f"timed rounds (default {rounds}; {quick_rounds} --quick)"
    )
    p.add_argument("--warmup", type=int, help=f"untimed rounds first (default {warmup}; 1 --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=Path,
        help="JSON report (default benchmarks/results/{cpu,gpu}/NAME.json; "
        "runs/benchmarks/NAME-quick.json with --quick)",
    )
    p.set_defaults(_rounds=(rounds, quick_rounds, warmup))
    return p


def finish_args(p: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> None:
    """Fill in the defaults that depend on ``--quick`` and the device; refuse a CUDA run
    where there is no GPU."""
    rounds, quick_rounds, warmup = args._rounds
    if args.rounds is None:
        args.rounds = quick_rounds if args.quick else rounds
    if args.warmup is None:
        args.warmup = 1 if args.quick else warmup
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.out is None:
        args.out = default_out(name, args.device, args.quick)


def default_out(name: str, device: str, quick: bool) -> Path:
    """Real runs go to ``benchmarks/results/{cpu,gpu}/``; smoke runs never overwrite them."""
    if quick:
        return Path("runs") / "benchmarks" / f"{name}-quick.json"
    return RESULTS / ("gpu" if device == "cuda" else "cpu") / f"{name}.json"


# -- the report ---------------------------------------------------------------------------------


def header(name: str, argv: Sequence[str] | None, settings: dict[str, Any]) -> dict[str, Any]:
    """What every JSON report starts with: what ran, where, when, at which commit."""
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "benchmark": name,
        "date": now_iso(),
        "commit": git_commit(),
        "trainguard": str(Path(trainguard.__file__).parent),
        "command": shlex.join(["python", f"benchmarks/{name}.py", *args]),
        "settings": settings,
        "machine": machine_info(),
        "load_average_start": load_average(),
    }


def finish(report: dict[str, Any], out: Path) -> None:
    report["load_average_end"] = load_average()
    write_json(out, report)
    print(f"\nJSON: {out}", file=sys.stderr)


def git_commit() -> str | None:
    """The checkout's commit, ``+dirty`` when ``src/`` or ``benchmarks/`` has changes."""
    root = HERE.parent

    def git(*cmd: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *cmd], capture_output=True, text=True, timeout=10
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        sha = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks")
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("+dirty" if dirty else "")) or None


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages (a busy machine makes timings noisy)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpus_available() -> int:
    """CPUs this process may run on (affinity), falling back to ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    cuda = torch.cuda.is_available()
    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": cpus_available(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "cuda_version": torch.version.cuda,
        "load_average": load_average(),
    }


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# -- measuring ----------------------------------------------------------------------------------


def round_order(names: Sequence[str], seed: int, index: int) -> list[str]:
    """The names in a fresh shuffled order for round ``index``; the same on every rank."""
    order = list(names)
    random.Random(f"{seed}:{index}").shuffle(order)
    return order


def interleave(
    names: Sequence[str],
    run: Callable[[str], T],
    rounds: int,
    warmup: int,
    seed: int = 0,
    log: str | None = None,
) -> dict[str, list[T]]:
    """``warmup`` untimed rounds, then ``rounds`` rounds; each round runs every name once in
    a freshly shuffled order, so drift of the machine hits every mode alike. Returns each
    name's results of the timed rounds, in round order (index i of every list: round i)."""
    out: dict[str, list[T]] = {name: [] for name in names}
    started = time.monotonic()
    for index in range(-warmup, rounds):
        for name in round_order(names, seed, index):
            value = run(name)
            if index >= 0:
                out[name].append(value)
        if log and index >= 0 and (index + 1) % 10 == 0:
            elapsed = time.monotonic() - started
            print(f"  {log}: round {index + 1}/{rounds} ({elapsed:.0f} s)", file=sys.stderr)
    return out


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def quick_dns() -> None:
    """c10d formats a socket's peer address with a reverse DNS lookup; where no DNS answers
    (sandboxes, some clusters' nodes), glibc's default 5 s x 2 attempts stall a connection
    for seconds. One attempt of 1 s for the processes this one starts (unless set)."""
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- statistics ---------------------------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """25th and 75th percentiles (both equal the value when there is only one)."""
    if len(values) < 2:
        return float(values[0]), float(values[0])
    q = statistics.quantiles(values, n=4, method="inclusive")
    return float(q[0]), float(q[2])


def bootstrap_ci(
    n: int, statistic: Callable[[list[int]], float], resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of ``statistic`` over rounds resampled with
    replacement (``statistic`` gets the round indices; pairing within a round is kept)."""
    rng = random.Random(seed)
    values = sorted(statistic([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def paired(values: Sequence[float], reference: Sequence[float]) -> dict[str, Any]:
    """``values`` against ``reference``, round by round: the ratio (median of the per-round
    ratios) and the difference (median of the per-round differences), each with a 95%
    bootstrap interval over the rounds (None with fewer than 5 rounds)."""
    ratios = [v / r for v, r in zip(values, reference, strict=True)]
    diffs = [v - r for v, r in zip(values, reference, strict=True)]
    n = len(ratios)

    def ci(xs: list[float]) -> list[float] | None:
        if n < 5:
            return None
        low, high = bootstrap_ci(n, lambda idx: median(xs[i] for i in idx))
        return [low, high]

    p25, p75 = quartiles(ratios)
    return {
        "ratio": median(ratios),
        "ratio_ci95": ci(ratios),
        "ratio_p25": p25,
        "ratio_p75": p75,
        "diff": median(diffs),
        "diff_ci95": ci(diffs),
    }


def verdict(value: float | None, limit: float, ci: Sequence[float] | None) -> str:
    """``met`` when the whole 95% interval is within ``limit`` (the median when there is no
    interval), ``missed`` when the whole interval is beyond it, else ``within noise``."""
    if value is None or not math.isfinite(value):
        return "missed"
    if ci is None:
        return "met" if value <= limit else "missed"
    if ci[1] <= limit:
        return "met"
    if ci[0] > limit:
        return "missed"
    return "within noise"


# -- tables -------------------------------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; numeric columns right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [bool(rows) and all(_is_number(row[i]) for row in rows) for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |"]
    lines.append("|" + "|".join("---:" if num else "---" for num in numeric) + "|")
    lines.extend("| " + " | ".join(row) + " |" for row in cells)
    return "\n".join(lines)


def interval(ci: Sequence[float] | None, digits: int = 3) -> str:
    return "-" if ci is None else f"{ci[0]:.{digits}f} .. {ci[1]:.{digits}f}"


def _is_number(value: object) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)
