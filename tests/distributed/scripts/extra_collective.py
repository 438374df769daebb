"""A collective one rank calls alone, with a size the peer's next collective does not have:
at step 10 rank 1 all-reduces 1,000 floats while rank 0 goes on into the guard's check.
Gloo aborts the rank whose receive does not match (``gloo::EnforceNotMet`` ->
``std::terminate`` -> SIGABRT) and torchrun then ends the other with SIGTERM: no Python code
runs on either. Each leaves its stacks through faulthandler (``hang/signal_dump.py``).

    torchrun --nproc-per-node=2 tests/distributed/scripts/extra_collective.py RUN_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))

from tg_models import TinyNet, loss_fn, make_batches

import trainguard as tg


def main() -> None:
    run_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tg.Guard(model, optimizer, run_dir=run_dir) as guard:  # GUARD BLOCK
        for step, batch in enumerate(guard.watch(make_batches(30, seed=rank))):
            loss = loss_fn(model, batch)
            loss.backward()
            if step == 10 and rank == 1:
                dist.all_reduce(torch.ones(1000))  # EXTRA COLLECTIVE
            if guard.check(loss):  # GUARD CHECK
                optimizer.step()
            optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
