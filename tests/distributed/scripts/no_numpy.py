"""A 2-rank DDP job (env:// rendezvous) in a Python where NumPy cannot be imported, as in an
environment that installed torch alone: the guard must agree on its run, skip rank 1's NaN
step on both ranks and capture it (the capture gathers each rank's notes).

    python no_numpy.py RUN_DIR OUT_DIR     (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
"""

from __future__ import annotations

import sys

sys.modules["numpy"] = None  # type: ignore[assignment]  # import numpy -> ImportError

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import trainguard as tg  # noqa: E402


def main() -> None:
    run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(2, 4, generator=gen) for _ in range(4)]
    if rank == 1:
        batches[2][0, 0] = float("nan")
    oks = []
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0) as guard:
        for x in guard.watch(batches):
            loss = model(x).square().mean()
            loss.backward()
            oks.append(guard.check(loss))
            opt.step()
            opt.zero_grad()
        run = guard.events.run.id if guard.events.run is not None else None
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    (out / f"rank{rank}.json").write_text(json.dumps({"oks": oks, "run": run, "w": weights}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
