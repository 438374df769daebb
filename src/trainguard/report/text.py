"""The text summary that ``trainguard report`` prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainguard.report.summary import RunSummary

_MAX_LISTED = 8
"""Items listed per section before "... and N more"."""


def report_text(summary: RunSummary, page: str | None = None) -> str:
    """The summary as aligned lines, one section per line (continuations indented)."""
    world = summary.world_size
    ranks = f" ({world} rank{'s' if world != 1 else ''})" if world else ""
    lines = [f"trainguard report: {summary.run_dir}"]
    rows: list[tuple[str, list[str]]] = [
        ("steps", [f"{summary.steps}{ranks}; {len(summary.points)} in the metrics log"]),
        ("decisions", [_decisions(summary.decisions)]),
        ("first bad", [_first_bad(summary.first_bad)]),
        ("non-finite", _listed(summary.nonfinite, _nonfinite)),
        ("captures", _captures(summary.captures, summary.run_dir)),
        ("spikes", _listed(summary.spikes, _spike)),
        ("rollbacks", _listed(summary.rollbacks, _rollback)),
        ("checkpoints", _listed(summary.checkpoints, _checkpoint)),
        ("escalations", _listed(summary.escalations, _escalation)),
        ("bad input", _listed(summary.bad_input, _bad_input)),
        ("hangs", _listed(summary.hangs, _hang)),
        ("uneven data", _listed(summary.uneven_data, _uneven)),
        ("skipped", _skipped(summary)),
    ]
    if page is not None:
        rows.append(("page", [page]))
    for title, body in rows:
        first, *rest = body or ["none"]
        lines.append(f"  {title:<12}{first}")
        lines.extend(f"  {'':<12}{line}" for line in rest)
    return "\n".join(lines)


def _decisions(decisions: dict[str, int]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in decisions.items() if n) or "none"


def _first_bad(event: dict[str, Any] | None) -> str:
    if event is None:
        return "none (every recorded step was finite on every rank)"
    return (
        f"step {event.get('step')}: non-finite {event.get('where')} on ranks "
        f"{event.get('ranks')} ({event.get('action')})"
    )


def _listed(items: list[dict[str, Any]], line: Any) -> list[str]:
    shown = [str(line(item)) for item in items[:_MAX_LISTED]]
    if len(items) > _MAX_LISTED:
        shown.append(f"... and {len(items) - _MAX_LISTED} more")
    return shown


def _nonfinite(e: dict[str, Any]) -> str:
    return f"step {e.get('step')}: {e.get('where')} on ranks {e.get('ranks')} -> {e.get('action')}"


def _captures(captures: list[dict[str, Any]], run_dir: str) -> list[str]:
    lines = []
    for c in captures:
        lines.append(f"step {c.get('step')} ({c.get('reason')}): {c.get('path')}")
        if c.get("diagnosis"):
            lines.append(f"  diagnosis: {c['diagnosis']}")
        else:
            bundle = Path(run_dir) / str(c.get("path"))
            lines.append(f"  not replayed yet: trainguard replay {bundle} --factory MODULE:FUNC")
    return lines


def _spike(e: dict[str, Any]) -> str:
    detail = ", ".join(
        f"{k} {e[k]:.4g}" if isinstance(e[k], float) else f"{k} {e[k]}"
        for k in ("value", "baseline", "ratio")
        if k in e
    )
    return f"step {e.get('step')}: {e.get('metric', '?')} spike ({detail}) -> {e.get('action')}"


def _rollback(e: dict[str, Any]) -> str:
    keys = ("restored_step", "rung", "attempt", "reason")
    extra = {k: e[k] for k in keys if e.get(k) is not None}
    fields = ", ".join(f"{k} {v}" for k, v in extra.items())
    return f"step {e.get('step')}: {e['kind']}" + (f" ({fields})" if fields else "")


def _checkpoint(e: dict[str, Any]) -> str:
    where = e.get("path") or e.get("from") or ""
    return f"step {e.get('step')}: {e['kind']}" + (f" {where}" if where else "")


def _bad_input(e: dict[str, Any]) -> str:
    return f"step {e.get('step')}: non-finite input on ranks {e.get('ranks')}"


def _escalation(e: dict[str, Any]) -> str:
    return f"step {e.get('step')}: {e.get('reason')}"


def _hang(h: dict[str, Any]) -> str:
    culprits = h.get("culprits") or "none identified"
    where = f" ({h['path']})" if h.get("path") else ""
    return (
        f"step {h.get('step')}: {h.get('kind')}, culprit ranks {culprits}: {h.get('reason')}{where}"
    )


def _uneven(e: dict[str, Any]) -> str:
    return (
        f"step {e.get('step')}: ranks {e.get('exhausted_ranks')} ran out of data "
        f"(batches per rank {e.get('batches')}; {e.get('dropped', 0)} dropped)"
    )


def _skipped(summary: RunSummary) -> list[str]:
    lines = [
        f"{name}: {n} unreadable line{'s' if n != 1 else ''}"
        for name, n in sorted(summary.skipped.lines.items())
    ]
    lines += [f"{name}: unreadable ({why})" for name, why in sorted(summary.skipped.files.items())]
    return lines
