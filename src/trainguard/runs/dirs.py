"""Which open Guards of this process write to which run dir.

Two Guards in one process (a GAN's generator and critic, an actor and a critic) each start a
run of their own; given the same ``run_dir``, both append to the same metrics log
(``metrics/rank-{r}.jsonl``, whose lines carry no run id: a line per step is kept short) and
capture folders, so ``trainguard report`` counts one guard's steps as the other's and a
replay counts the other guard's captures as this run's. ``claim`` says so once, when the
second Guard opens the dir (a warning naming the fix: a run dir per Guard); the claim ends at
``close()``, or when the Guard is garbage-collected without one.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

_open: dict[str, list[str]] = {}
"""Resolved run dir -> the run ids of the open Guards writing to it."""


def claim(owner: object, run_dir: Path, run_id: str) -> Callable[[], None]:
    """Note that ``owner`` (a Guard) writes run ``run_id`` to ``run_dir``; warn when another
    open Guard of this process already does. Returns the release (idempotent)."""
    key = str(run_dir.resolve())
    others = _open.setdefault(key, [])
    if others:
        logger.warning(
            "trainguard: run_dir %s is also the run dir of another open Guard in this process "
            "(run %s): their metrics logs mix and `trainguard report` cannot tell their steps "
            "apart; give each Guard its own run_dir (a folder per model: %s)",
            run_dir,
            others[0],
            run_dir / "<model>",
        )
    others.append(run_id)
    return weakref.finalize(owner, _release, key, run_id)


def _release(key: str, run_id: str) -> None:
    ids = _open.get(key)
    if ids is not None and run_id in ids:
        ids.remove(run_id)
        if not ids:
            del _open[key]


def open_runs(run_dir: Path) -> list[str]:
    """The run ids open Guards of this process write to ``run_dir`` (tests, diagnostics)."""
    return list(_open.get(str(run_dir.resolve()), []))
