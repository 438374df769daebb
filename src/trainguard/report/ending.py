"""The ``ended`` line: how the run's last start ended.

From the ``close`` events written after the last ``start`` (every rank writes its own):

- one with ``error``: the exception that ended it (``with Guard``, ``close()`` in a
  ``finally``, or an uncaught one at the interpreter's exit: ``step/unclosed.py``);
- ``closed: false`` without an error: the guard was never closed (the script ended, or
  dropped it);
- a plain ``close``: closed;
- none: the process did not get to write one (a hang or peer failure ends it with
  ``os._exit``: the ``hangs`` line says why; else it was killed: SIGKILL, the OOM killer,
  a scheduler's time limit).
"""

from __future__ import annotations

from typing import Any

from trainguard.report.readers import float_of, int_of


def ending(events: list[dict[str, Any]], hangs: list[dict[str, Any]]) -> str:
    """The ``ended`` line of the run whose (time-ordered) ``events`` these are."""
    starts = [float_of(e.get("time")) for e in events if e["kind"] == "start"]
    since = max(starts, default=float("-inf"))
    closes = [e for e in events if e["kind"] == "close" and float_of(e.get("time")) >= since]
    last = max((int_of(e.get("step")) for e in events), default=0)
    if not closes:
        if hangs:
            return f"step {hangs[-1].get('step')}: {hangs[-1].get('kind')} (see hangs)"
        return (
            f"no close event: the process was killed (SIGKILL, the OOM killer, a time limit) "
            f"or left with os._exit; its last event at step {last}"
        )
    failed = [e for e in closes if e.get("error")]
    if failed:
        first = min(failed, key=lambda e: float_of(e.get("time")))
        ranks = sorted({int_of(e.get("rank")) for e in failed})
        return f"step {first.get('step')}: {first.get('error')} (ranks {ranks})"
    step = max(int_of(e.get("step")) for e in closes)
    if any(e.get("closed") is False for e in closes):
        return f"step {step}: the guard was never closed (the script ended without close())"
    return f"step {step}: closed"
