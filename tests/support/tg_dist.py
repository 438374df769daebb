"""Run a function on N real processes joined in a gloo process group.

Each test gets a free port and a hard deadline: a hang kills every worker and fails the
test instead of eating CI. Results (or the exception each rank raised) come back per rank.

The ranks start from a fork server that has imported torch and trainguard once per pytest
worker (``forkserver`` with a preload): a fresh interpreter per rank (``spawn``) paid the
import of torch, about 1.7 s of CPU, for each of the suite's ~400 ranks on a 2-core machine.
A forked rank is still a fresh process for the test: the server has run no torch op (no
thread pools, no process group), each rank gets the caller's environment as it is at
``run_ranks`` (``spawn``'s semantics, not the server's), and the test's function is
imported in the child, as under ``spawn``.
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: BaseException | None = None
    error_type: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    elapsed: float = 0.0


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: the tests run two at a time
    (``pytest -n 2``), and a port taken from the ephemeral range (``bind(0)``) may be handed
    to the other test's gloo connections between this pick and the store's bind a few
    seconds later; below the range the kernel assigns nothing on its own."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as sock:  # every one taken: the ephemeral way
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_command(script: Path | str, *args: str, ranks: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` of ``script`` on ``ranks`` local ranks, with the
    c10d rendezvous on a free port (a fault-tolerant job's launch)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(script),
        *args,
    ]


def torchrun_env() -> dict[str, str]:
    """The environment for ``torchrun_command``: one thread a rank, a fresh rendezvous store
    per restart (pytorch/pytorch#135712), no guard of ``trainguard run`` around it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop("TRAINGUARD_RUN", None)
    return env


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text(encoding="utf-8")
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    out: str,
    pg_timeout: float,
    env: dict[str, str],
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    start = time.monotonic()
    result = RankResult(rank)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
        )
        result.value = fn(rank, world_size, *args)
    except BaseException as exc:  # report everything to the parent
        result.error_type = type(exc).__name__
        result.traceback = traceback.format_exc()
        try:
            pickle.dumps(exc)
            result.error = exc
        except Exception:
            result.error = None
    result.elapsed = time.monotonic() - start
    with open(out + ".tmp", "wb") as fh:
        pickle.dump(result, fh)
    os.replace(out + ".tmp", out)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


PRELOAD = ["torch", "torch.distributed", "trainguard", "torch._dynamo"]
"""What the fork server imports once, before it forks any rank. ``torch._dynamo``: the first
``DistributedDataParallel(...)`` of a process imports it (about 800 modules, 1.3 s of CPU on
the 2-core machine, torch 2.13), so every rank of a DDP test paid it again; a real DDP worker
has it imported too by the time its guard is built (and the guard reads only whether it is)."""


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: float = 30.0,
) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes forked from the
    preloaded server."""
    ctx = _context()
    port = free_port()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [str(Path(tmp) / f"rank-{r}.pkl") for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, world_size, port, args, outs[r], pg_timeout, env),
            )
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout}s (killed)")
        results = []
        for rank, (proc, out) in enumerate(zip(procs, outs, strict=True)):
            if os.path.exists(out):
                with open(out, "rb") as fh:
                    result = pickle.load(fh)
            else:
                result = RankResult(rank, error_type="NoResult")
            result.exitcode = proc.exitcode
            results.append(result)
        return results


def values(results: list[RankResult]) -> list[Any]:
    """The ranks' return values; fails with every rank's traceback if any rank raised."""
    failed = [r for r in results if r.error_type is not None]
    if failed:
        details = "\n".join(f"--- rank {r.rank} ---\n{r.traceback}" for r in failed)
        raise AssertionError(f"ranks {[r.rank for r in failed]} failed:\n{details}")
    return [r.value for r in results]


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
)
"""The ``torch.distributed`` collectives ``count_collectives`` wraps."""


def count_collectives(calls: list[tuple[str, int]]) -> None:
    """In this process, record every collective called from now on as ``(name, numel)`` of
    its first tensor argument (-1: none), in ``torch.distributed`` and ``distributed_c10d``."""
    import torch
    import torch.distributed as dist

    for name in COLLECTIVES:
        for module in (dist, dist.distributed_c10d):
            original = getattr(module, name, None)
            if original is None:
                continue

            def wrapper(*args: Any, _name: str = name, _orig: Any = original, **kw: Any) -> Any:
                tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
                calls.append((_name, tensor.numel() if tensor is not None else -1))
                return _orig(*args, **kw)

            setattr(module, name, wrapper)


def cpu_fully_shard(*modules: Any) -> None:
    """``fully_shard`` each module (inner ones first) over a CPU mesh of the whole gloo world.
    Without a mesh, FSDP2 shards over CUDA wherever a GPU is visible and moves the
    parameters there, so a test's CPU batches would meet CUDA weights on a GPU machine."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in modules:
        fully_shard(module, mesh=mesh)
