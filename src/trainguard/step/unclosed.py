"""A Guard that is never closed: dropped, or still open when the interpreter exits.

Loops end without ``close()`` all the time: an exception escapes a loop that closes the
guard after it (no ``finally``), a script ends without calling it, a sweep builds one Guard
per trial and drops it. Then the metrics lines still buffered would be lost (the report
would say "steps 0"), the watchdog thread and its store connection would live on (one per
dropped guard), and nothing would say how the run ended.

``watch(owner, parts)`` ties a ``weakref.finalize`` to the Guard: when it is collected, or at
the interpreter's exit, the parts are released as ``close()`` would (without its policy: no
pending step is decided, nothing raises) and a ``close`` event says ``closed: false``, with
``error``: the exception that ended the interpreter, when one did (``sys.last_value``).
``close()`` detaches it.
"""

from __future__ import annotations

import logging
import sys
import weakref
from dataclasses import dataclass
from typing import Any

from trainguard.events import EventLog
from trainguard.hang.progress import Progress
from trainguard.step.history import StepHistory
from trainguard.step.state import GuardState

logger = logging.getLogger(__name__)


@dataclass
class UnclosedParts:
    """What releasing an unclosed Guard needs (never the Guard itself: it must be free to
    be collected)."""

    progress: Progress
    state: GuardState
    events: EventLog
    history: StepHistory
    closers: list[Any]
    """Parts with a ``close()``/``stop()`` of their own: the watchdog, the step-start hooks,
    the straggler timer's hooks."""


def watch(owner: object, parts: UnclosedParts) -> weakref.finalize[[UnclosedParts], object]:
    """Release ``parts`` when ``owner`` is collected or the interpreter exits unclosed
    (``close()`` calls the returned finalizer's ``detach()``)."""
    return weakref.finalize(owner, _release, parts)


def error_text(exc: BaseException | None) -> str | None:
    """``"KeyError: 'labels'"`` for the event's ``error`` field (None: no exception)."""
    return None if exc is None else f"{type(exc).__name__}: {exc}"[:500]


def _release(parts: UnclosedParts) -> None:
    try:
        parts.progress.enter("closed")
        for part in parts.closers:
            stop = getattr(part, "stop", None) or part.close
            stop()
        error = error_text(getattr(sys, "last_value", None))
        fields: dict[str, Any] = {"closed": False} | ({"error": error} if error else {})
        state = parts.state
        parts.events.write("close", state.step, total_nonfinite=state.total_nonfinite, **fields)
        parts.events.close()
        parts.history.close()
    except Exception as exc:  # at exit: say it, never raise
        logger.warning("trainguard: releasing an unclosed Guard failed: %s", exc)
