"""The ``ended`` line: how the run's last start ended.

From the ``close`` events written after the last ``start`` (every rank writes its own):

- one with ``error``: the exception that ended it (``with Guard``, ``close()`` in a
  ``finally``, or an uncaught one at the interpreter's exit: ``step/unclosed.py``), at the
  step it was raised in. A ``close`` event records the guard's step counter, the next step
  it would check; when the guard itself stopped the run (an ``escalate`` event, a non-finite
  step under ``on_nonfinite="raise"``, an escalated spike), that counter is one past the
  step that raised, so the line names the stopping step instead;
- ``closed: false`` without an error: the guard was never closed (the script ended, or
  dropped it);
- a plain ``close``: closed;
- some ranks with one and others without, and a hang report: the hang or peer failure
  ended those with ``os._exit`` (the ranks that left without closing are named);
- none, and a rank's signal stacks (``report/crashes.py``): a signal ended it (the first
  fatal one is named: SIGABRT, SIGSEGV; a launcher's SIGTERM follows it);
- none: the process did not get to write one (a hang or peer failure ends it with
  ``os._exit``: the ``hangs`` line says why; else it was killed: SIGKILL, the OOM killer,
  a scheduler's time limit). The line says the last step seen in the events and the
  metrics log together (the log is written by rank 0 only, in batches: it can be ahead of
  the events of a quiet run and behind those of a killed one);
- no events at all (``events/`` missing or unreadable): how it ended is unknown.
"""

from __future__ import annotations

from typing import Any

from trainguard.report.readers import float_of, int_of


def ending(
    events: list[dict[str, Any]],
    hangs: list[dict[str, Any]],
    records: list[dict[str, Any]] | None = None,
    crashes: list[dict[str, Any]] | None = None,
) -> str:
    """The ``ended`` line of the run whose (time-ordered) ``events`` these are; ``records``:
    its metrics log lines (each with an int ``step``); ``crashes``: its ranks that a signal
    ended (``report/crashes.py``)."""
    records = records or []
    if not events and not hangs:
        return _no_events(records)
    starts = [float_of(e.get("time")) for e in events if e["kind"] == "start"]
    since = max(starts, default=float("-inf"))
    closes = [e for e in events if e["kind"] == "close" and float_of(e.get("time")) >= since]
    if not closes:
        if hangs:
            return f"step {hangs[-1].get('step')}: {hangs[-1].get('kind')} (see hangs)"
        if crashes:
            silent = _started_ranks(events, since) - {int_of(c.get("rank")) for c in crashes}
            return _ended_by_signal(crashes, sorted(silent), _last_seen(events, records, since))
        return (
            "no close event: the process was killed (SIGKILL, the OOM killer, a time limit) "
            f"or left with os._exit; last seen at step {_last_seen(events, records, since)}"
        )
    failed = [e for e in closes if e.get("error")]
    if failed:
        first = min(failed, key=lambda e: float_of(e.get("time")))
        ranks = sorted({int_of(e.get("rank")) for e in failed})
        step = _raised_at(events, since, int_of(first.get("step")))
        return f"step {step}: {first.get('error')} (ranks {ranks})"
    unclosed = _started_ranks(events, since) - {int_of(e.get("rank")) for e in closes}
    if hangs and unclosed:  # a hang or peer failure ended the others with os._exit
        hang = hangs[-1]
        left = sorted(int_of(e.get("rank")) for e in closes if e.get("closed") is False)
        also = f"; rank {', '.join(map(str, left))} left without closing its guard" if left else ""
        return f"step {hang.get('step')}: {hang.get('kind')} (see hangs){also}"
    step = max(int_of(e.get("step")) for e in closes)
    if any(e.get("closed") is False for e in closes):
        return f"step {step}: the guard was never closed (the script ended without close())"
    return f"step {step}: closed"


def _ended_by_signal(crashes: list[dict[str, Any]], silent: list[int], last_seen: int) -> str:
    """The first fatal signal's rank; else the ranks that left no word (killed with SIGKILL,
    which no handler sees, or ``os._exit``), to which the launcher's SIGTERMs of the others
    answered; else the first SIGTERM's."""
    fatal = sorted(
        (c for c in crashes if c.get("signal") != "SIGTERM"), key=lambda c: float_of(c.get("time"))
    )
    terminated = [c for c in crashes if c.get("signal") == "SIGTERM"]
    parts = [f"rank {c.get('rank')} ended by {c.get('signal')}" for c in fatal]
    if silent:
        ranks = ", ".join(map(str, silent))
        parts.append(
            f"rank {ranks} ended without a close event or signal stacks (SIGKILL, the OOM "
            "killer, or os._exit)"
        )
    for crash in terminated:
        verb = "by" if parts else "ended by"
        parts.append(f"rank {crash.get('rank')} {verb} {crash.get('signal')}")
    if fatal:
        parts[0] += " (see crashes)"
    elif terminated:
        parts[-1] += " (see crashes)"
    return "; ".join(parts) + f"; last seen at step {last_seen}"


def _started_ranks(events: list[dict[str, Any]], since: float) -> set[int]:
    """The ranks that wrote the last start's ``start`` event (or any event since)."""
    return {int_of(e.get("rank")) for e in events if float_of(e.get("time")) >= since}


def _no_events(records: list[dict[str, Any]]) -> str:
    """No readable event: no ``start``, no ``close``; only the metrics log says anything."""
    seen = (
        f"; the metrics log's last step is {max(int_of(r.get('step')) for r in records)}"
        if records
        else ""
    )
    return f"unknown: no readable events (events/ missing or unreadable){seen}"


def _last_seen(events: list[dict[str, Any]], records: list[dict[str, Any]], since: float) -> int:
    """The highest step the last start's events or metrics lines name."""
    steps = [int_of(e.get("step")) for e in events if float_of(e.get("time")) >= since]
    steps += [int_of(r.get("step")) for r in records if float_of(r.get("time")) >= since]
    return max(steps, default=0)


_STOPS = {"escalate": None, "nonfinite": ("raise", "escalate"), "spike": ("escalate",)}
"""Events of the guard stopping the run: any ``escalate``; a ``nonfinite`` or ``spike`` one
whose ``action`` raised."""


def _raised_at(events: list[dict[str, Any]], since: float, closed_at: int) -> int:
    """The step an error was raised in: the guard's own stop's (the close event's counter
    is one past it), else the close event's step (an exception raised in the loop's step)."""
    for event in reversed(events):
        if float_of(event.get("time")) < since:
            break
        actions = _STOPS.get(event["kind"], ())
        if actions is None or (actions and event.get("action") in actions):
            step = int_of(event.get("step"))
            return step if step + 1 == closed_at else closed_at
    return closed_at
