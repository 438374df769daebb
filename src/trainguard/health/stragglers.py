"""Which rank slows the job: a rule over the per-rank times every rank already agreed on.

(Being written: the interface the guard calls is final.)
"""

from __future__ import annotations

import logging

from trainguard.config import GuardConfig
from trainguard.events import EventLog

logger = logging.getLogger(__name__)


class StragglerWatch:
    """Fed each decided step's per-rank data and compute seconds (identical on every rank)."""

    def __init__(self, config: GuardConfig, events: EventLog, rank: int) -> None:
        self._config = config
        self._events = events
        self._rank = rank

    def observe(self, step: int, data_times: list[float], compute_times: list[float]) -> None:
        """One decided step's per-rank times (the same lists on every rank)."""
