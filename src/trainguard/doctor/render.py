"""The report as text for a terminal (``--json`` prints ``DoctorReport.to_dict()`` instead)."""

from __future__ import annotations

from typing import Any

from trainguard.doctor.findings import DoctorReport, Finding

SECTIONS = ("environment", "variables", "rendezvous", "ranks", "smoke")
MARK = {"ok": "ok  ", "info": "info", "warn": "WARN", "fail": "FAIL"}


def report_text(report: DoctorReport) -> str:
    if not report.full_text:
        return short_text(report)
    lines = [_title(report)]
    for section in SECTIONS:
        found = [f for f in report.findings if f.section == section]
        if not found and section != "smoke":
            continue
        lines.append("")
        lines.append(section)
        lines.extend(_finding_lines(f, report.rank) for f in found)
        if section == "ranks" and len(report.ranks) > 1:
            lines.extend(_ranks_table(report.ranks))
        if section == "smoke":
            lines.extend(_smoke_lines(report.smoke))
    lines.append("")
    lines.append(_verdict(report))
    return "\n".join(lines)


def short_text(report: DoctorReport) -> str:
    """Ranks other than 0: one line (rank 0 prints the job's report)."""
    return (
        f"trainguard doctor: rank {report.rank} of {report.world_size}: {_counts(report)} "
        f"(exit {report.exit_code}); rank 0 prints the job's report"
    )


def _title(report: DoctorReport) -> str:
    host = report.environment.get("host", "?")
    if report.rank is None:
        return f"trainguard doctor on {host}"
    return f"trainguard doctor on {host}: rank {report.rank} of {report.world_size}"


def _finding_lines(finding: Finding, own_rank: int | None) -> str:
    name = finding.check.split(".", 1)[1] if "." in finding.check else finding.check
    text = finding.message
    if finding.rank is not None and finding.rank != own_rank and f"rank {finding.rank}" not in text:
        text = f"rank {finding.rank}: {text}"
    head = f"  {MARK[finding.status]}  "
    head += text if finding.section == "variables" else f"{name:<13} {text}"
    if finding.fix and finding.status != "ok":
        head += f"\n        fix: {finding.fix}"
    return head


def _ranks_table(ranks: list[dict[str, Any]]) -> list[str]:
    columns = ("rank", "host", "torch", "cuda", "nccl", "python", "driver", "device")
    rows = [[_cell(r.get(c)) for c in columns] + [_seconds(r.get("arrival_s"))] for r in ranks]
    return _table([*columns, "checked in"], rows)


def _smoke_lines(smoke: dict[str, Any] | None) -> list[str]:
    if smoke is None:
        return []
    if "skipped" in smoke:
        return [f"  skipped: {smoke['skipped']}"]
    per_rank: dict[str, dict[str, float | None]] = smoke["per_rank"]
    ops = list(dict.fromkeys(op for times in per_rank.values() for op in times))
    rows = [[op] + [_millis(per_rank[r].get(op)) for r in per_rank] for op in ops]
    lines = [f"  backend {smoke['backend']} on {smoke['device']}; time per op and rank:"]
    lines.extend(_table(["op", *(f"rank {r}" for r in per_rank)], rows))
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip()] + [fmt.format(*row).rstrip() for row in rows]


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _seconds(value: Any) -> str:
    return "-" if value is None else f"+{float(value):.2f} s"


def _millis(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _counts(report: DoctorReport) -> str:
    fails = sum(f.status == "fail" for f in report.findings)
    warns = sum(f.status == "warn" for f in report.findings)
    return f"{fails} failure(s), {warns} warning(s)"


def _verdict(report: DoctorReport) -> str:
    state = "healthy" if report.exit_code == 0 else "findings above"
    return f"{_counts(report)}: {state} (exit {report.exit_code})"
