"""A small guarded training job run as a plain process (one per rank), as on separate hosts.

Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment (set by the test
or by torchrun) and joins a gloo process group through ``env://``: rank 0's process serves
the TCPStore unless torchrun's agent does.

Options: ``--stall-rank R --stall-step S`` blocks rank R forever inside its data loader
when it fetches batch S (with ``--once``: only while ``RUN_DIR/stalled-once`` does not
exist, so a restarted job completes). The loop is a plain ``for batch in guard.watch(...)``
without ``with``: an exception escaping it reaches the chained ``sys.excepthook``.

Files in RUN_DIR: ``progress-rank{r}`` (the step reached), ``stalled-rank{r}`` (unix time of
the stall), ``done-rank{r}`` (JSON: attempt, steps) when the job completes.
``--raise-rank R --raise-step S``: rank R raises at step S (escaping the loop).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))

from tg_models import TinyNet, loss_fn, make_batches

import trainguard as tg


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def block_forever_in_loader() -> None:
    threading.Event().wait()


def loader(args: argparse.Namespace, rank: int) -> Iterator[torch.Tensor]:
    once = args.run_dir / "stalled-once"
    for index, batch in enumerate(make_batches(args.steps, seed=rank)):
        stall = rank == args.stall_rank and index == args.stall_step
        if stall and not (args.once and once.exists()):
            once.touch()
            write_atomic(args.run_dir / f"stalled-rank{rank}", repr(time.time()))
            block_forever_in_loader()
        yield batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--stall-rank", type=int, default=-1)
    parser.add_argument("--stall-step", type=int, default=-1)
    parser.add_argument("--once", action="store_true")
    parser.add_argument("--raise-rank", type=int, default=-1)
    parser.add_argument("--raise-step", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = tg.Guard(model, optimizer, run_dir=args.run_dir, hang_timeout=args.timeout)
    progress = args.run_dir / f"progress-rank{rank}"
    for batch in guard.watch(loader(args, rank)):
        if rank == args.raise_rank and guard.state.step == args.raise_step:
            raise RuntimeError(f"boom on rank {rank} at step {args.raise_step}")
        loss = loss_fn(model, batch)
        loss.backward()
        guard.step(loss)
        write_atomic(progress, str(guard.state.step))
        time.sleep(args.step_sleep)
    guard.close()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    done = {"attempt": attempt, "steps": guard.state.step}
    write_atomic(args.run_dir / f"done-rank{rank}", json.dumps(done))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
