"""Do the ranks step with the same learning rate: each rank's LR rides the step's agreement.

Replicas step alike only with the same learning rate. A rank whose LR differs (its own
scheduler state after a bad resume, a one-rank fault, an LR set by hand on one rank) is
about to step its replica apart, and every rule that read a rank's own LR would decide
apart from the others. The rules read the agreed LR (``Agreement.lr``, the smallest rank's);
this watch says when the ranks' LRs differ: a ``lr_mismatch`` event on every rank at the
first step of each such stretch, naming the ranks outside the majority, and one warning on
rank 0. No collective of its own: the LRs came with the step's all-reduce.
"""

from __future__ import annotations

import logging

from trainguard.events import EventLog
from trainguard.health.replicas import majority

logger = logging.getLogger(__name__)


class LrAgreement:
    """Watches the agreed per-rank learning rates; the same events on every rank."""

    def __init__(self, events: EventLog, rank: int) -> None:
        self._events = events
        self._rank = rank
        self._differing = False
        self.mismatches = 0
        """Stretches of steps whose ranks' learning rates differed."""

    def observe(self, step: int, lrs: list[float], differ: bool) -> None:
        """One step's learning rates (per rank, 0.0: unknown) and whether they differ
        (``Agreement.lrs_differ``)."""
        if differ == self._differing:
            return
        self._differing = differ
        if not differ:
            return
        self.mismatches += 1
        verdict = majority(lrs)
        self._events.write("lr_mismatch", step, lrs=lrs, ranks=verdict.ranks, tie=verdict.tie)
        if self._rank == 0:
            apart = "no majority" if verdict.tie else f"rank(s) {verdict.ranks} apart"
            logger.warning(
                "trainguard: step %d: the ranks' learning rates differ (%s: %s): their "
                "replicas will step apart; the guard's rules read the smallest",
                step,
                ", ".join(f"{lr:.4g}" for lr in lrs),
                apart,
            )
