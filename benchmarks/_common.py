"""Shared helpers of the benchmarks: machine description, statistics, tables, JSON, docs.

Not a package module: the benchmark scripts import it from their own folder.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import random
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


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
    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": cpus_available(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cuda_version": torch.version.cuda,
        "load_average": load_average(),
    }


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


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


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [
        all(_is_number(row[i]) for row in rows) if rows else False for i in range(len(headers))
    ]
    lines = ["| " + " | ".join(headers) + " |"]
    lines.append("|" + "|".join("---:" if num else "---" for num in numeric) + "|")
    lines.extend("| " + " | ".join(row) + " |" for row in cells)
    return "\n".join(lines)


def _is_number(value: object) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def replace_block(path: Path, name: str, text: str) -> None:
    """Replace what lies between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in ``path``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    page = path.read_text(encoding="utf-8")
    head, sep, rest = page.partition(begin)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise SystemExit(
            f"{path}: markers {begin} / {end} not found; add them where the table goes"
        )
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{head}{begin}\n{text.strip()}\n{end}{tail}", encoding="utf-8")
    os.replace(tmp, path)
