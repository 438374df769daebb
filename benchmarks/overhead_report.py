"""The overhead benchmark's reporting: the targets and their verdicts (a 95% bootstrap
interval over the rounds), the markdown tables, the text of a report (``render``), and
reports read back from JSON (``load_report``, ``render_targets_of_runs``).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import bootstrap_ci, markdown_table, median
from overhead_modes import PHASES


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


def load_report(path: Path) -> dict[str, Any]:
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
