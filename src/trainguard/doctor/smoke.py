"""The collective smoke test: all_reduce, all_gather, broadcast, barrier with their results
checked, then the bandwidth of a large all_reduce.

Each op writes where this rank is (``progress(index, name)``) before it starts, so that a rank
stuck in an op can be told from one that never reached it. The bandwidth figures follow
nccl-tests: ``algbw = bytes / time`` and ``busbw = algbw * 2 (n - 1) / n`` for all_reduce (the
bytes every rank's link carries in a ring all-reduce, comparable across world sizes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

BANDWIDTH_ITERS = 3
"""Timed all_reduce runs after one warm-up; the median is reported."""

Progress = Callable[[int, str], None]


@dataclass
class OpResult:
    name: str
    ok: bool
    seconds: float
    detail: str = ""
    """What went wrong (empty when ok); for the bandwidth op, the numbers."""
    extra: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], None]) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _check(name: str, seconds: float, got: torch.Tensor, expected: torch.Tensor) -> OpResult:
    if torch.equal(got.cpu(), expected.cpu()):
        return OpResult(name, True, seconds)
    wrong = (got.cpu() != expected.cpu()).nonzero()
    first = int(wrong[0, 0]) if wrong.numel() else 0
    detail = (
        f"wrong result: element {first} is {got.flatten()[first].item()}, "
        f"expected {expected.flatten()[first].item()} ({wrong.shape[0]} elements differ)"
    )
    return OpResult(name, False, seconds, detail)


def all_reduce_op(rank: int, world: int, device: torch.device) -> OpResult:
    tensor = torch.full((1024,), float(rank + 1), device=device)
    seconds = _timed(device, lambda: dist.all_reduce(tensor))
    expected = torch.full((1024,), float(world * (world + 1) // 2))
    return _check("all_reduce", seconds, tensor, expected)


def all_gather_op(rank: int, world: int, device: torch.device) -> OpResult:
    mine = torch.full((256,), float(rank), device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    seconds = _timed(device, lambda: dist.all_gather(out, mine))
    expected = torch.arange(world, dtype=torch.float32).repeat_interleave(256)
    return _check("all_gather", seconds, torch.cat(out), expected)


def broadcast_op(rank: int, world: int, device: torch.device) -> OpResult:
    reference = torch.arange(1024, dtype=torch.float32) * 3 + 7
    tensor = reference.to(device) if rank == 0 else torch.zeros(1024, device=device)
    seconds = _timed(device, lambda: dist.broadcast(tensor, src=0))
    return _check("broadcast", seconds, tensor, reference)


def barrier_op(rank: int, world: int, device: torch.device) -> OpResult:
    ids = [device.index or 0] if device.type == "cuda" else None
    seconds = _timed(device, lambda: dist.barrier(device_ids=ids))
    return OpResult("barrier", True, seconds)


def bandwidth_op(world: int, device: torch.device, nbytes: int) -> OpResult:
    """Median time of ``BANDWIDTH_ITERS`` all_reduces of ``nbytes`` (float32 ones: every
    element must come back equal to the world size)."""
    tensor = torch.ones(nbytes // 4, device=device)
    times: list[float] = []
    for i in range(BANDWIDTH_ITERS + 1):
        tensor.fill_(1.0)
        seconds = _timed(device, lambda: dist.all_reduce(tensor))
        if i > 0:
            times.append(seconds)
    median = statistics.median(times)
    size = tensor.numel() * 4
    algbw = size / median / 1e9
    busbw = algbw * 2 * (world - 1) / world
    extra = {"bytes": size, "times_s": times, "algbw_gbps": algbw, "busbw_gbps": busbw}
    if not bool(tensor.eq(float(world)).all()):
        return OpResult("bandwidth", False, median, "wrong result in the large all_reduce", extra)
    return OpResult("bandwidth", True, median, extra=extra)


def run_ops(
    rank: int, world: int, device: torch.device, bandwidth_bytes: int, progress: Progress
) -> list[OpResult]:
    """Every op in order; stops at the first that raises (the group is broken after it)."""
    ops: list[tuple[str, Callable[[], OpResult]]] = [
        ("all_reduce", lambda: all_reduce_op(rank, world, device)),
        ("all_gather", lambda: all_gather_op(rank, world, device)),
        ("broadcast", lambda: broadcast_op(rank, world, device)),
        ("barrier", lambda: barrier_op(rank, world, device)),
    ]
    if bandwidth_bytes > 0:
        ops.append(("bandwidth", lambda: bandwidth_op(world, device, bandwidth_bytes)))
    results: list[OpResult] = []
    for index, (name, op) in enumerate(ops, start=1):
        progress(index, name)
        start = time.perf_counter()
        try:
            results.append(op())
        except (RuntimeError, ValueError) as exc:  # gloo/NCCL timeouts and errors
            first_line = (
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            )
            results.append(OpResult(name, False, time.perf_counter() - start, first_line))
            return results  # progress stays at the op that failed
    progress(len(ops) + 1, "done")
    return results
