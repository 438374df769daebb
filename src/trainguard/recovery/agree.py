"""Small collectives: every rank chose the same value (a step to restore), a flag true on
every rank, the largest of a few numbers over the ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist


def same_on_every_rank(value: int, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True when ``value`` is identical on every rank (one all-reduce of two numbers)."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    both = torch.tensor([value, -value], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return int(both[0].item()) == -int(both[1].item()) == value


def true_on_every_rank(flag: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True when ``flag`` is true on every rank (one all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item() == 1.0)


def max_over_ranks(
    values: list[int], group: dist.ProcessGroup | None, device: torch.device
) -> list[int]:
    """Each of ``values``' largest value over every rank (one all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    both = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in both.tolist()]
