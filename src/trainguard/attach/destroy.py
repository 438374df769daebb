"""The script's ``destroy_process_group()`` closes the guard first: ``trainguard run`` wraps
torch's function (in ``torch.distributed`` and ``distributed_c10d``, where scripts call it)
for as long as its hooks are in, so the guard's last collectives run while the default group
still exists."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def close_before_destroy(close: Callable[[], None]) -> Callable[[], None] | None:
    """Wrap ``destroy_process_group`` so that destroying the default group runs ``close``
    first; returns what puts torch's own back (None: no torch.distributed)."""
    if not dist.is_available():
        return None
    from torch.distributed import distributed_c10d

    original = distributed_c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        if group is None:
            close()
        original(group)

    def restore() -> None:
        for namespace in (dist, distributed_c10d):
            if getattr(namespace, "destroy_process_group", None) is destroy_process_group:
                setattr(namespace, "destroy_process_group", original)  # noqa: B010

    for namespace in (dist, distributed_c10d):
        setattr(namespace, "destroy_process_group", destroy_process_group)  # noqa: B010
    return restore
