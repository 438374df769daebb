"""Do the replicas still agree: a fingerprint of the replicated weights rides the step's
agreement every ``replica_check_every`` steps.

(Being written: the interface the guard calls is final.)
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainguard.config import GuardConfig
from trainguard.events import EventLog

logger = logging.getLogger(__name__)


class ReplicaWatch:
    """Fingerprints the replicated weights when due; acts on a disagreement."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: GuardConfig,
        events: EventLog,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        self._model = model
        self._zero: Tensor | None = None

    def fingerprint(self, step: int, device: torch.device) -> Tensor:
        """A float64 0-d tensor on ``device``: the fingerprint when due at ``step``, else 0."""
        if self._zero is None or self._zero.device != device:
            self._zero = torch.zeros((), dtype=torch.float64, device=device)
        return self._zero

    def observe(self, step: int, fingerprints: list[float]) -> None:
        """The agreed fingerprints of ``step`` (identical on every rank): on a disagreement,
        an event and ``on_divergence`` (warn, resync by broadcast, raise) on every rank."""
