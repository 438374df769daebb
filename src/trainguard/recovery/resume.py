"""Resume: load the newest good checkpoint that every rank can load, agreed.

Candidates are tried newest first (the folder must be shared by every rank). Each rank loads
the candidate and says whether it could; one all-reduce decides. A damaged checkpoint gives
a ``checkpoint_damaged`` event and the previous good one is tried; none at all gives a
``resume`` event with ``from_step`` None and a fresh start, never a silent one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.errors import ConfigError
from trainguard.events import EventLog
from trainguard.recovery import checkpoint as ckpt
from trainguard.recovery.agree import same_on_every_rank, true_on_every_rank
from trainguard.recovery.snapshot import TrainingObjects

logger = logging.getLogger(__name__)


@dataclass
class Resumed:
    step: int
    path: Path
    extras: dict[str, Any]
    first_loss: float | None


def _try_load(path: Path, objects: TrainingObjects, rank: int) -> tuple[dict[str, Any], str]:
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return ckpt.load(path, objects, rank), ""
    except (Exception, CheckpointException) as exc:  # a BaseException: caught by name
        # damaged or partial: reported, and the previous one is tried
        return {}, f"{type(exc).__name__}: {exc}"[:500]


def _same_world_size(path: Path, group: dist.ProcessGroup | None) -> None:
    """Refuse (on every rank: they read the same manifest) a checkpoint written by another
    number of ranks: each rank's data position, loader state and buffers are its own."""
    written = ckpt.world_size_of(path)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if written is None or written == world:
        return
    ranks = f"{written} rank" + ("s" if written != 1 else "")
    raise ConfigError(
        "resume",
        f"{path} was written by {ranks} and this job has {world}: a resume goes on with "
        "each rank's own data position, loader state and buffers, which another world size "
        f"cannot do (samples would be trained twice or skipped); run with {ranks}, or start "
        "a new run (resume=False, or another run_dir) from its weights",
    )


def resume(
    run_dir: Path,
    objects: TrainingObjects,
    events: EventLog,
    group: dist.ProcessGroup | None,
    device: torch.device,
    rank: int,
) -> Resumed | None:
    """Collective. The checkpoint loaded (into ``objects``), or None: a fresh start."""
    candidates = ckpt.good_checkpoints(run_dir)
    count = len(candidates)
    if not same_on_every_rank(count, group, device):
        raise RuntimeError(
            f"trainguard resume: ranks see different checkpoints under {run_dir}/checkpoints "
            "(the run folder must be shared by every rank)"
        )
    for path in candidates:
        _same_world_size(path, group)
        step = ckpt.step_of(path)
        extras, error = _try_load(path, objects, rank)
        if true_on_every_rank(not error, group, device):
            return Resumed(step, path, extras, ckpt.first_loss(path))
        events.write("checkpoint_damaged", step, path=str(path), error=error or None)
        if rank == 0:
            logger.warning("trainguard: checkpoint %s is damaged; trying the previous", path)
    events.write("resume", 0, from_step=None, reason="no good checkpoint", found=count)
    return None
