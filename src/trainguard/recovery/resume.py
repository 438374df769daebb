"""Resume: load the freshest state every rank can be given, agreed.

A state at a failure (``failure/``) newer than the newest good checkpoint comes first
(``resume_freshest``); else the newest good checkpoint every rank can load. Checkpoint
candidates are tried newest first (the folder must be shared by every rank). Each rank loads
the candidate and says whether it could; one all-reduce decides. A damaged checkpoint gives
a ``checkpoint_damaged`` event and the previous good one is tried; none at all gives a
``resume`` event with ``from_step`` None and a fresh start, never a silent one.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.distributed.elastic import RESTART_HAZARD_FIX, restart_store_hazard
from trainguard.distributed.world import world_size
from trainguard.errors import ConfigError
from trainguard.events import EventLog
from trainguard.recovery import checkpoint as ckpt
from trainguard.recovery.agree import same_on_every_rank, true_on_every_rank
from trainguard.recovery.failure.part import FailureState
from trainguard.recovery.snapshot import TrainingObjects
from trainguard.recovery.types import DataPoint

logger = logging.getLogger(__name__)


@dataclass
class Resumed:
    """What a resume loaded: its step, the checkpoint (None: a state at a failure), the
    extras saved with it (``guard``, ``recovery``, ``data``, ``rng``) and the first loss
    recorded after it."""

    step: int
    path: Path | None
    extras: dict[str, Any]
    first_loss: float | None
    source: dict[str, Any] = field(default_factory=dict)
    """The ``resume`` event's fields naming the source."""

    @property
    def point(self) -> DataPoint:
        """Where the data continues."""
        data = self.extras["data"]
        return DataPoint(int(data["epoch"]), int(data["position"]), data.get("loader"))

    @property
    def rng(self) -> tuple[int, dict[str, Any], str]:
        """The step's RNG states and the moment they go back (``Boundary.at``)."""
        return self.step, self.extras["rng"], self.extras.get("rng_at", "forward")


def resume_freshest(
    run_dir: Path,
    objects: TrainingObjects,
    failure: FailureState | None,
    events: EventLog,
    group: dist.ProcessGroup | None,
    device: torch.device,
    rank: int,
) -> Resumed | None:
    """Collective, at construction: load the freshest state every rank can be given (a state
    at a failure, else the newest good checkpoint) and write the ``resume`` event."""
    hazard = restart_store_hazard(os.environ)
    if hazard is not None:  # said on the first attempt, before a restart can fail
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one line per torchrun (per node)
            logger.warning("%s; fix: %s", hazard, RESTART_HAZARD_FIX)
        events.write("restart_config", 0, message=hazard, fix=RESTART_HAZARD_FIX)
    found: Resumed | None = None
    if failure is not None:
        good = ckpt.good_checkpoints(run_dir)
        newest = ckpt.step_of(good[0]) if good else -1
        fresh = failure.resume(group, device, newest)
        if fresh is not None:
            source = {
                "source": "failure_state",
                "saved_by": fresh.saved_by,
                "from_records": fresh.from_records,
                "source_rank": fresh.source,
            }
            found = Resumed(fresh.step, None, fresh.extras, None, source)
    if found is None:
        found = resume(run_dir, objects, events, group, device, rank)
    if found is None:
        return None
    point = found.point
    path = {"path": str(found.path)} if found.path is not None else {}
    events.write(
        "resume",
        found.step,
        from_step=found.step,
        epoch=point.epoch,
        position=point.position,
        loader_state=point.loader_state is not None,
        **path,
        **found.source,
    )
    return found


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
    world = world_size(group)
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
