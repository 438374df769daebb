"""Starting a Guard's hang watchdog (``watchdog.Watchdog``): the members of its process group,
the store it talks through (its own connections to the job's c10d store, under a prefix of
this guard's generation and group) and the collective probe of that group. Monitoring never
takes the job down: a watchdog that cannot start is an event and a warning, not an error.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from pathlib import Path

import torch.distributed as dist

from trainguard.events import EventLog
from trainguard.hang import keys
from trainguard.hang import timeout as timing
from trainguard.hang.channel import StoreChannel, own_connection
from trainguard.hang.collectives import CollectiveProbe
from trainguard.hang.keys import store_prefix
from trainguard.hang.progress import Progress
from trainguard.hang.timeout import TimeoutLearner
from trainguard.hang.watchdog import Watchdog

logger = logging.getLogger(__name__)

_generations = itertools.count()


def start_watchdog(
    progress: Progress,
    events: EventLog,
    hang_timeout: float | None,
    run_dir: Path,
    group: dist.ProcessGroup | None = None,
) -> Watchdog | None:
    """Start the watchdog of a Guard; None when torch.distributed is not initialized or
    ``hang_timeout == 0``."""
    if hang_timeout == 0 or not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    rank = dist.get_rank()
    if group is not None:
        members = sorted(dist.get_process_group_ranks(group))
    else:
        members = list(range(dist.get_world_size()))
    learner = TimeoutLearner(fixed=hang_timeout)
    io_timeout = min(5.0, max(1.0, timing.dead_after(learner.value(0)) / 2.0))
    store = distributed_c10d._get_default_store()
    prefix = store_prefix(next(_generations))
    if group is not None:
        digest = hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:8]
        prefix += f"-{digest}"
    try:
        watchdog = Watchdog(
            channel=StoreChannel(own_connection(store, io_timeout), prefix, rank, members),
            main_channel=StoreChannel(own_connection(store, io_timeout), prefix, rank, members),
            progress=progress,
            events=events,
            run_dir=run_dir,
            learner=learner,
            store_host=keys.store_host(),
            probe=CollectiveProbe(group_name(group)),
        )
        watchdog.start()
    except Exception as exc:  # monitoring must not take the job down
        logger.warning("trainguard: hang watchdog not started: %s", exc)
        events.write("watchdog_unavailable", progress.step, error=f"{type(exc).__name__}: {exc}")
        return None
    return watchdog


def group_name(group: dist.ProcessGroup | None) -> str:
    """The process group's name as torch's flight recorder keys it (``"0"``: the default)."""
    pg = group if group is not None else dist.group.WORLD
    return str(getattr(pg, "group_name", "0"))
