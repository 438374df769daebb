"""This process's place in the job: its rank and the job's size, 0 and 1 without an
initialized process group (a script that never called ``init_process_group``)."""

from __future__ import annotations

import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if initialized() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """The size of ``group`` (default: the default group; 1 without a process group)."""
    return dist.get_world_size(group) if initialized() else 1
