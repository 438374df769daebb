"""Which run of a ``run_dir`` a Guard belongs to: every event carries the run's id.

People re-run a script with the same ``run_dir``; each such launch is a run of its own, so
that ``trainguard report`` does not add two runs' steps together and "the first bad step" is
per run. The rule, decided once when the Guard is built:

- a torchrun restart of the job (``TORCHELASTIC_RESTART_COUNT`` > 0) continues the latest
  run in ``run_dir``;
- a resume (``GuardConfig.resume``, or an integration resuming from the framework's
  checkpoint: ``GuardConfig.run="continue"``) continues the latest run;
- anything else is a new run, with a new id: the UTC time and a short random suffix
  (``20261123-094011-a3f2``), so ids sort by start time;
- ``GuardConfig.run`` overrides: ``"new"``, ``"continue"`` or an explicit id to continue.

"The latest run" is the run of the newest event in ``events/rank-0.jsonl`` (only its tail is
read). A run dir with no event carrying a run id (written before runs had ids, or empty)
has no run to continue: the guard starts a new one. Rank 0 decides and the id reaches the
other ranks in one object broadcast at construction (none in a single process), so it is
the same on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # imported where used: ``GuardConfig`` checks ``run`` without torch
    import torch
    import torch.distributed as dist

logger = logging.getLogger(__name__)

NEW = "new"
CONTINUE = "continue"
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""What an explicit run id may look like (it is typed on the command line: ``--run ID``)."""
TAIL_BYTES = 64 * 1024
"""How much of the end of ``events/rank-0.jsonl`` is read to find the latest run."""


@dataclass(frozen=True)
class RunIdentity:
    """The run a Guard writes to, and why (``origin``)."""

    id: str
    origin: str
    """``new``, ``restart`` (a torchrun restart), ``resume`` or ``given`` (``GuardConfig.run``
    named the id)."""

    def start_fields(self) -> dict[str, object]:
        """What the ``start`` event records of it (the id itself is on every event)."""
        return {"run_origin": self.origin}


class _Group(Protocol):
    """What the guard's agreement knows of its process group (``step.consensus.Consensus``)."""

    @property
    def group(self) -> dist.ProcessGroup | None: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def distributed(self) -> bool: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


def new_run_id(now: datetime | None = None) -> str:
    """A new id: UTC start time to the second and 4 random hex digits (sortable)."""
    when = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return f"{when:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def check_run_option(value: object) -> None:
    """``GuardConfig.run``: None, ``"new"``, ``"continue"`` or a run id (ValueError: why)."""
    if value is None or value in (NEW, CONTINUE):
        return
    if not isinstance(value, str) or RUN_ID_PATTERN.fullmatch(value) is None:
        raise ValueError(
            f"got {value!r}; use None (decided: a new run unless torchrun restarts or resumes "
            f"it), {NEW!r}, {CONTINUE!r} (the latest run in run_dir) or a run id "
            "(letters, digits, '.', '_', '-')"
        )


def continues(resume: bool, choice: str | None, env: Mapping[str, str]) -> str | None:
    """Why this guard continues an existing run (``restart``, ``resume``, ``given``), or None
    when it starts a new one."""
    if choice == NEW:
        return None
    if choice is not None and choice != CONTINUE:
        return "given"
    from trainguard.distributed.elastic import restart_count

    if restart_count(env) > 0:
        return "restart"
    if resume or choice == CONTINUE:
        return "resume"
    return None


def latest_run(run_dir: Path | str) -> str | None:
    """The run of the newest event of rank 0 that names one (None: no such event)."""
    path = Path(run_dir) / "events" / "rank-0.jsonl"
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - TAIL_BYTES))
            tail = fh.read()
    except OSError:
        return None
    for line in reversed(tail.decode("utf-8", errors="replace").splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn by a kill, or cut by the tail
        run = record.get("run") if isinstance(record, dict) else None
        if isinstance(run, str) and run:
            return run
    return None


def decide_run(
    run_dir: Path | str, resume: bool, choice: str | None, env: Mapping[str, str]
) -> RunIdentity:
    """Rank 0's decision (see the module docstring)."""
    why = continues(resume, choice, env)
    if why == "given" and choice is not None:
        return RunIdentity(choice, "given")
    if why is not None:
        found = latest_run(run_dir)
        if found is not None:
            return RunIdentity(found, why)
        logger.info("trainguard: no earlier run in %s to continue (%s): a new run", run_dir, why)
    return RunIdentity(new_run_id(), NEW)


def identify_run(
    run_dir: Path | str,
    resume: bool,
    choice: str | None,
    group: _Group,
    env: Mapping[str, str] | None = None,
) -> RunIdentity:
    """The run on every rank: rank 0 decides, one object broadcast over the guard's group."""
    import torch.distributed as dist

    from trainguard.distributed.objects import broadcast_object

    env = os.environ if env is None else env
    ident = decide_run(run_dir, resume, choice, env) if group.rank == 0 else None
    if group.distributed and group.world_size > 1:
        src = dist.get_global_rank(group.group, 0) if group.group is not None else 0
        ident = broadcast_object(ident, src, group.group, group.device)  # no NumPy needed
    if ident is None:  # pragma: no cover - the broadcast always delivers rank 0's
        raise RuntimeError("trainguard: the run id did not reach this rank")
    if group.rank == 0 and ident.origin != NEW:
        logger.info("trainguard: continuing run %s (%s)", ident.id, ident.origin)
    return ident
