"""Building the guard's recovery part, and its final stop record.

``build_recovery`` makes the ``Recovery`` when a recovery option is on (and resumes when asked);
``record_final_stop`` writes the stop record of an escalation recovery does not answer.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.capture.optim_state import is_zero
from trainguard.config import GuardConfig
from trainguard.distributed.elastic import restart_count
from trainguard.errors import ConfigError, NonFiniteError
from trainguard.events import EventLog
from trainguard.recovery import snapshot as snap
from trainguard.recovery.failure import store
from trainguard.recovery.manager import Recovery
from trainguard.recovery.scheduler_lead import unknown_scheduler
from trainguard.recovery.stop import record_stop
from trainguard.recovery.types import Stateful

logger = logging.getLogger(__name__)


def record_final_stop(
    config: GuardConfig,
    rank: int,
    error: NonFiniteError,
    recovery: Recovery | None,
    cause: str | None = None,
) -> None:
    """The guard's final stop (an escalation it does not roll back): rank 0 writes
    ``run_dir/stop.json``, which a restart into the same failure is refused by. ``cause``:
    ``"spike"`` for a spike escalation, else taken from the error. Never raises."""
    watched = recovery.watched if recovery is not None else None
    record_stop(config, rank, error, watched, restart_count(os.environ), cause)


def recovery_enabled(config: GuardConfig) -> bool:
    return config.recovery.enabled


def build_recovery(
    config: GuardConfig,
    objects: snap.TrainingObjects,
    guard_state: Stateful,
    events: EventLog,
    group: dist.ProcessGroup | None,
    device: torch.device,
    rank: int,
) -> Recovery | None:
    """The guard's recovery part, or None when no recovery option is on."""
    if not config.recovery.resume:  # a new run: an earlier run's states are not its own
        store.forget(Path(config.run_dir), config.recovery.failure_state_dir)
    if not recovery_enabled(config):
        return None
    if config.recovery.checkpoint_every > 0 and is_zero(objects.optimizer):
        raise ConfigError(
            "checkpoint_every",
            "a ZeroRedundancyOptimizer's state is sharded over the ranks and the checkpoints "
            "on disk (torch.distributed.checkpoint) cannot gather it; use recovery.snapshot_every "
            "(in-memory rollbacks keep each rank's shard) and your own checkpoints "
            "(consolidate_state_dict), or checkpoint_every=0",
        )
    recovery = Recovery(config, objects, guard_state, events, group, device, rank)
    if objects.scheduler is None and unknown_scheduler(objects.optimizer) and rank == 0:
        logger.warning(
            "trainguard: an LR scheduler steps this optimizer but was not given to the guard: "
            "rollbacks, checkpoints and resume will not restore its schedule; pass it as "
            "Guard(..., scheduler=...)"
        )
    if config.recovery.resume:
        try:
            recovery.resume()
        except BaseException:
            recovery.abandon()
            raise
    return recovery
