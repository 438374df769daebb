"""Names the watchdog agrees on through the store: the key prefix of one Guard, the run's
hang id candidate, and which rank serves the store."""

from __future__ import annotations

import os
import secrets
import time

from trainguard.distributed.elastic import RESTART_VAR, restart_count


def store_host() -> int | None:
    """The rank whose process serves the store: rank 0 for ``init_process_group``'s own
    TCPStore, none under torchrun (the agent serves it)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"
    return None if agent else 0


def store_prefix(generation: int) -> str:
    """Keys of one Guard: torchrun's store outlives a restart, so the run id and the restart
    count are part of the prefix (``generation`` counts the Guards of this process)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = _attempt()
    if run or attempt:
        return f"trainguard/{run}/attempt{attempt}/{generation}"
    return f"trainguard/{generation}"


def candidate_id() -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    attempt = _attempt()
    suffix = f"-attempt{attempt}" if attempt else ""
    return f"{stamp}{suffix}-{secrets.token_hex(2)}"


def _attempt() -> str:
    """The job's attempt (agreed across ranks: ``elastic.agree_attempt``), "" outside
    torchrun."""
    return str(restart_count(os.environ)) if RESTART_VAR in os.environ else ""
