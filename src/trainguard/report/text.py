"""The text summary that ``trainguard report`` prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainguard.events import number
from trainguard.report.crashes import crash_line
from trainguard.report.readers import int_of
from trainguard.report.runs import LEGACY
from trainguard.report.summary import RunSummary

_MAX_LISTED = 8
"""Items listed per section before "... and N more"."""


def report_text(summary: RunSummary, page: str | None = None) -> str:
    """The summary as aligned lines, one section per line (continuations indented)."""
    world = summary.world_size
    ranks = f" ({world} rank{'s' if world != 1 else ''})" if world else ""
    lines = [f"trainguard report: {summary.run_dir}"]
    rows: list[tuple[str, list[str]]] = [
        *([("run", [_run(summary)])] if summary.run is not None else []),
        ("steps", [_steps(summary, ranks)]),
        *(
            [("stood aside", [_aside(e) for e in summary.stood_aside])]
            if summary.stood_aside
            else []
        ),
        *([("ended", [summary.ended])] if _unusual(summary.ended) else []),
        ("decisions", [_decisions(summary.decisions)]),
        ("first bad", [_first_bad(summary)]),
        ("non-finite", _listed(summary.nonfinite, _nonfinite)),
        ("captures", _captures(summary.captures, summary.run_dir) + _failed(summary)),
        ("spikes", _listed(summary.spikes, _spike)),
        ("rollbacks", _listed(summary.rollbacks, _rollback)),
        ("checkpoints", _listed(summary.checkpoints, _checkpoint) or [_NO_CHECKPOINTS]),
        *(
            [("at failure", _listed(summary.failure_states, _failure_state))]
            if summary.failure_states
            else []
        ),
        ("escalations", _listed(summary.escalations, _escalation)),
        ("bad input", _listed(summary.bad_input, _bad_input)),
        ("hangs", _listed(summary.hangs, _hang) + _listed(summary.failed_too, _failed_too)),
        *([("crashes", _listed(summary.crashes, crash_line))] if summary.crashes else []),
        ("uneven data", _listed(summary.uneven_data, _uneven)),
        ("stragglers", _listed(summary.stragglers, _straggler)),
        ("replicas", _listed(summary.replicas, _replica)),
        ("reruns", _listed(summary.reruns, _rerun)),
        ("hosts", _hosts(summary.hosts)),
        ("timing", _timing(summary)),
        ("unreadable", _unreadable(summary)),
    ]
    if page is not None:
        rows.append(("page", [page]))
    for title, body in rows:
        first, *rest = body or ["none"]
        lines.append(f"  {title:<12}{first}")
        lines.extend(f"  {'':<12}{line}" for line in rest)
    return "\n".join(lines)


_NO_CHECKPOINTS = "none of the guard's (checkpoint_every; the loop's own are not seen here)"


def _steps(summary: RunSummary, ranks: str) -> str:
    line = f"{summary.steps}{ranks}; {len(summary.points)} in the metrics log"
    first = summary.first_step
    if first:
        line += f"; started at step {first} (a saved state)"
    again = summary.steps_run - (summary.steps - first)
    if again > 0:
        causes = [
            c for c, n in (("restarts", summary.starts > 1), ("rollbacks", summary.rollbacks)) if n
        ]
        after = " and ".join(causes) or "restarts"
        return line + f"; {summary.steps_run} run ({again} again after {after})"
    return line + (f"; {summary.steps_run} run" if first else "")


def _run(summary: RunSummary) -> str:
    """The run's id and start; with others in the directory, how to see them (one line)."""
    info = next((r for r in summary.runs if r.get("id") == summary.run), {})
    started = f", started {info['start_utc']} UTC" if info.get("start_utc") else ""
    more = f", {info['starts']} starts" if info.get("starts", 1) > 1 else ""
    line = f"{summary.run}{started}{more}"
    if summary.run == LEGACY:
        line += " (events written before runs had ids)"
    if len(summary.runs) > 1:
        line += f"; {len(summary.runs)} runs here (--runs lists them; --run ID or --run all)"
    return line


def runs_text(run_dir: str, runs: list[dict[str, Any]], shown: str | None) -> str:
    """``trainguard report RUN_DIR --runs``: one line per run, oldest first."""
    lines = [f"trainguard report: {run_dir}: {len(runs)} run{'s' if len(runs) != 1 else ''}"]
    lines.append(f"  {'run':<24}{'started (UTC)':<22}{'steps':>7}{'starts':>8}")
    for run in runs:
        mark = "  (latest: shown by default)" if run.get("id") == shown else ""
        lines.append(
            f"  {run.get('id')!s:<24}{run.get('start_utc')!s:<22}{run.get('steps')!s:>7}"
            f"{run.get('starts')!s:>8}{mark}"
        )
    return "\n".join(lines)


def _decisions(decisions: dict[str, int]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in decisions.items() if n) or "none"


def _first_bad(summary: RunSummary) -> str:
    event = summary.first_bad
    if event is None and summary.events:
        return "none (every recorded step was finite on every rank)"
    if event is None:  # no readable events: only the metrics log can tell
        if not summary.points:
            return "unknown (no readable events or metrics log)"
        return "none in the metrics log (no readable events)"
    source = "; from the metrics log: no readable events" if event.get("from") else ""
    return (
        f"step {event.get('step')}: non-finite {event.get('where')}{_on_ranks(event)} "
        f"({event.get('action')}{source})"
    )


def _on_ranks(event: dict[str, Any]) -> str:
    """`` on ranks [..]`` (nothing when unknown: a non-finite gradient norm in the log)."""
    ranks = event.get("ranks")
    return "" if ranks is None else f" on ranks {ranks}"


def _listed(items: list[dict[str, Any]], line: Any) -> list[str]:
    shown = [str(line(item)) for item in items[:_MAX_LISTED]]
    if len(items) > _MAX_LISTED:
        shown.append(f"... and {len(items) - _MAX_LISTED} more")
    return shown


def _nonfinite(e: dict[str, Any]) -> str:
    return f"step {e.get('step')}: {e.get('where')}{_on_ranks(e)} -> {e.get('action')}"


def _captures(captures: list[dict[str, Any]], run_dir: str) -> list[str]:
    lines = []
    for c in captures:
        lines.append(f"step {c.get('step')} ({c.get('reason')}): {c.get('path')}")
        for made in c.get("made_in_loop") or []:
            lines.append(
                f"  rank {made['rank']}'s forward got non-finite input at {made['where']} "
                "that its fetched batch did not hold: made in the loop before the forward"
            )
        if c.get("diagnosis"):
            lines.append(f"  diagnosis: {c['diagnosis']}")
        else:
            bundle = Path(run_dir) / str(c.get("path"))
            lines.append(f"  not replayed yet: trainguard replay {bundle} --factory MODULE:FUNC")
    return lines


def _aside(e: dict[str, Any]) -> str:
    return (
        f"step {e.get('step')} on rank {e.get('rank')}: {e.get('reason')}; "
        f"{e.get('then') or 'the script runs unguarded'}"
    )


def _failed(summary: RunSummary) -> list[str]:
    """Captures the guard tried and could not write (``capture_failed``), with why."""
    return [
        f"step {e.get('step')} ({e.get('reason')}): capture failed on rank {e.get('rank')}: "
        f"{e.get('error')}"
        for e in summary.capture_failures
    ]


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
    if e.get("source") == "failure_state":
        records = e.get("from_records") or []
        line = f"step {e.get('step')}: resume from the state at the failure saved by ranks "
        line += f"{e.get('saved_by')}"
        return line + (f" (ranks {records} from their step-start records)" if records else "")
    if e["kind"] == "failure_state_refused":
        return f"step {e.get('step')}: a state at the failure refused: {e.get('reason')}"
    where = e.get("path") or e.get("from") or ""
    return f"step {e.get('step')}: {e['kind']}" + (f" {where}" if where else "")


def _failure_state(group: dict[str, Any]) -> str:
    """``step 37: saved by ranks [0]; not by rank 1 (why)``."""
    line = f"step {group.get('step')}: saved by ranks {sorted(group.get('saved') or [])}"
    for missing in group.get("not_saved") or []:
        line += f"; not by rank {missing.get('rank')} ({missing.get('reason')})"
    return line


def _bad_input(e: dict[str, Any]) -> str:
    line = f"step {e.get('step')}: non-finite input on ranks {e.get('ranks')}"
    tensors = [t for t in e.get("tensors") or [] if isinstance(t, dict)]
    where = [_bad_tensor(t) for t in tensors[:_MAX_LISTED] if not t.get("additive_mask")]
    if where:
        line += ": " + "; ".join(where)
    if tensors and all(t.get("additive_mask") for t in tensors):
        from trainguard.capture import batchpaths  # imports torch: only for such an event

        found = sorted({str(t.get("path")) for t in tensors})
        names = tuple(dict.fromkeys(batchpaths.ignore_name(path) for path in found))
        leave_out = f"inputs.ignore={names!r}" if all(names) else "inputs.check=False"
        line += (
            f" ({', '.join(found)}: only 0 and -inf, an additive mask: {leave_out} if deliberate)"
        )
    return line


def _bad_tensor(t: dict[str, Any]) -> str:
    """``rank 1 [0]['x'] samples [2] (dataset indices [13])``: where a bad input was."""
    rank = f"rank {t['rank']} " if t.get("rank") is not None else ""
    indices = t.get("dataset_indices")
    found = f" (dataset indices {indices})" if indices else ""
    return f"{rank}{t.get('path') or '<batch>'} samples {t.get('positions')}{found}"


def _escalation(e: dict[str, Any]) -> str:
    streak = e.get("consecutive")
    in_a_row = f" ({streak} in a row)" if isinstance(streak, int) and streak > 1 else ""
    outcome = f" -> {e['outcome']}" if e.get("outcome") else ""
    return f"step {e.get('step')}: {e.get('reason')}{in_a_row}{outcome}"


def _hang(h: dict[str, Any]) -> str:
    culprits = h.get("culprits") or "none identified"
    where = f" ({h['path']})" if h.get("path") else ""
    return (
        f"step {h.get('step')}: {h.get('kind')}, culprit ranks {culprits}: {h.get('reason')}{where}"
        + _no_stack(h.get("no_stack") or {})
    )


def _no_stack(no_stack: dict[str, list[int]]) -> str:
    """What the hang's stack files lack: empty ones (the rank died before it wrote) and
    those on another host."""
    said = []
    if no_stack.get("empty"):
        ranks = ", ".join(map(str, no_stack["empty"]))
        said.append(
            f"no stack from rank {ranks} (it ended before it could write one: killed, "
            "aborted or its own exception)"
        )
    if no_stack.get("elsewhere"):
        ranks = ", ".join(map(str, no_stack["elsewhere"]))
        said.append(f"stacks of rank {ranks} are on their own hosts")
    return "".join(f"; {part}" for part in said)


def _unusual(ended: str) -> bool:
    """The ``ended`` line is shown unless the run simply closed."""
    return bool(ended) and not ended.endswith(": closed")


def _failed_too(e: dict[str, Any]) -> str:
    return f"step {e.get('step')}: {e.get('reason')}"


def _uneven(e: dict[str, Any]) -> str:
    if e.get("kind") == "partial_step":
        return (
            f"step {e.get('step')}: the pass ended {e.get('dropped')} batch(es) short of a step "
            f"of {e.get('accumulation_steps')}: not trained"
        )
    return (
        f"step {e.get('step')}: ranks {e.get('exhausted_ranks')} ran out of data "
        f"(batches per rank {e.get('batches')}; {e.get('dropped', 0)} dropped)"
    )


def _rerun(e: dict[str, Any]) -> str:
    where = f" on ranks {e.get('ranks')}" if e.get("ranks") else ""
    return f"step {e.get('step')}: {e.get('verdict')}{where} (hosts {e.get('hosts') or '-'})"


def _hosts(hosts: dict[str, dict[str, int]]) -> list[str]:
    """Transient and persistent reruns per host; a suspect host flagged."""
    return [
        f"{host}: {row['transient']} transient, {row['persistent']} persistent"
        + ("  SUSPECT (drained: exit 94)" if row.get("suspect") else "")
        for host, row in hosts.items()
    ]


def _replica(e: dict[str, Any]) -> str:
    """A replica divergence: who differs from whom, in what, and what was done."""
    params = e.get("params") or []
    count = int_of(e.get("params_differing")) or len(params)
    shown = ", ".join(map(str, params[:3])) + (f" and {count - 3} more" if count > 3 else "")
    against = "a tie: no majority" if e.get("tie") else f"rank {e.get('majority_rank')}"
    return (
        f"step {e.get('step')}: ranks {e.get('ranks')} differ from {against} in {shown} "
        f"({e.get('action')})"
    )


def _straggler(e: dict[str, Any]) -> str:
    ranks, phase = e.get("ranks"), e.get("phase")
    slowdown, lost = number(e.get("slowdown")), number(e.get("lost_per_step"))
    if not ranks:
        return f"step {e.get('step')}: over ({phase}): ranks {e.get('recovered')} caught up"
    detail = f"{slowdown:.1f}x the median rank" if slowdown is not None else "slow"
    cost = f", {lost * 1e3:.1f} ms lost per step" if lost is not None else ""
    return f"step {e.get('step')}: ranks {ranks} slow in {phase} ({detail}{cost})"


def _timing(summary: RunSummary) -> list[str]:
    """Per rank median data / compute milliseconds (the slowest ranks past ``_MAX_LISTED``)."""
    if summary.timing_summary and not summary.timing:
        return [_phase_line(phase, v) for phase, v in summary.timing_summary.items()]
    rows = summary.timing
    if not rows:
        return []
    named = _named_ranks(summary.stragglers)
    shown = rows
    if len(rows) > _MAX_LISTED:  # the slowest ranks, in rank order
        slowest = sorted(rows, key=lambda r: r["data"] + r["compute"], reverse=True)
        shown = sorted(slowest[: _MAX_LISTED - 1], key=lambda r: r["rank"])
    steps = rows[0]["steps"]
    lines = [f"{'rank':<6}{'data ms':>9}{'forward ms':>12}  (medians over {steps} logged steps)"]
    data_measured = any(row["data"] > 0 or row.get("data_seen") for row in rows)
    for row in shown:
        flag = f"  straggler: {', '.join(named[row['rank']])}" if row["rank"] in named else ""
        data = f"{row['data'] * 1e3:>9.2f}" if data_measured else f"{'-':>9}"
        lines.append(f"{row['rank']:<6}{data}{row['compute'] * 1e3:>12.2f}{flag}")
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} faster ranks not listed")
    if not data_measured:
        lines.append(
            "data time not measured (0 at every step): the loop fetched its batches without "
            "watch(), or each fetch took under a microsecond"
        )
    return lines


def _phase_line(phase: str, v: dict[str, Any]) -> str:
    slowest = ", ".join(f"rank {r} ({n} steps)" for r, n in v.get("slowest_ranks", []))
    return (
        f"{phase}: median {v['median'] * 1e3:.2f} ms over {v['steps']} logged steps; "
        f"most often the slowest: {slowest or 'none'}"
    )


def _named_ranks(stragglers: list[dict[str, Any]]) -> dict[int, list[str]]:
    """The ranks any ``straggler`` event named, with the phases."""
    named: dict[int, list[str]] = {}
    for e in stragglers:
        for rank in e.get("ranks") or []:
            phases = named.setdefault(rank, [])
            if e.get("phase") not in phases:
                phases.append(str(e.get("phase")))
    return named


def _unreadable(summary: RunSummary) -> list[str]:
    """Log lines and files the report could not read (skipped, not counted as steps)."""
    lines = [
        f"{name}: {n} unreadable line{'s' if n != 1 else ''}"
        for name, n in sorted(summary.skipped.lines.items())
    ]
    lines += [f"{name}: unreadable ({why})" for name, why in sorted(summary.skipped.files.items())]
    return lines
