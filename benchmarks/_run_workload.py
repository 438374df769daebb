"""The transformer workload of ``overhead_modes`` as a plain training script that knows
nothing of trainguard: what ``run_overhead.py`` runs bare and under ``trainguard run``.

One process, or DDP (gloo) under torchrun. Times each step (forward, backward, optimizer
step, zero_grad) after ``--warmup`` steps and writes rank 0's times as JSON to ``--out``.
The model is ``_gpt.TinyGPT`` (trainguard-free) at ``overhead_modes``' ``cpu`` sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

START = time.monotonic()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _gpt import TinyGPT  # noqa: E402
from torch import nn  # noqa: E402

SIZES = {"vocab": 4096, "dim": 256, "layers": 4, "heads": 4, "seq": 128, "batch": 8}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed = "LOCAL_RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    s = SIZES
    net = TinyGPT(s["vocab"], s["dim"], s["layers"], s["heads"], s["seq"])
    model: nn.Module = nn.parallel.DistributedDataParallel(net) if distributed else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(rank)
    times: list[float] = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=gen)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        started = time.perf_counter()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    if rank == 0:
        result = {"step_s": times, "process_s": time.monotonic() - START, "loss": loss.item()}
        args.out.write_text(json.dumps(result))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
