"""The per-step budget under DDP: one small all-reduce, no batch or weight copies.

Collectives issued from Python are counted by wrapping torch.distributed's functions (DDP's
own gradient all-reduces run in its C++ reducer and are not counted: they are not ours).
Copies are looked for at the aten level during ``watch()`` and ``check()``, and at the Python
level with a batch type that refuses to be copied.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import count_collectives, run_ranks, values
from tg_models import TinyNet
from tg_ops import OpRecorder
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from trainguard.step.consensus import COLUMNS


class CopyRefusingBatch:
    """A batch that fails the test if anything copies or pickles it."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __copy__(self) -> Any:
        raise AssertionError("the batch was copied")

    def __deepcopy__(self, memo: Any) -> Any:
        raise AssertionError("the batch was deep-copied")

    def __reduce__(self) -> Any:
        raise AssertionError("the batch was pickled")


def _job(rank: int, world: int, root: str, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(TinyNet(d_in=64, hidden=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = [CopyRefusingBatch(torch.randn(8, 64)) for _ in range(steps)]
    calls: list[tuple[str, int]] = []
    per_step: list[int] = []
    big_copies: list[tuple[str, list[int]]] = []
    seen_ids: list[bool] = []
    with tg.Guard(model, opt, run_dir=Path(root), capture=True) as guard:
        count_collectives(calls)
        batches = guard.watch(loader)
        for i in range(steps):
            with OpRecorder() as fetch:
                batch = next(batches)
            seen_ids.append(batch is loader[i])
            loss = model(batch.x).pow(2).mean()
            loss.backward()
            before = len(calls)
            with OpRecorder() as rec:
                ok = guard.check(loss)
            per_step.append(len(calls) - before)
            assert ok
            opt.step()
            opt.zero_grad()
            for name, sizes in fetch.ops + rec.ops:
                copying = name in ("clone", "copy_", "_to_copy", "cat", "stack")
                if copying and sizes and max(sizes) > world * 6 + 1:
                    big_copies.append((name, sizes))
        assert list(batches) == []
    return {"calls": calls, "per_step": per_step, "big": big_copies, "same": seen_ids}


@pytest.mark.timeout(90)
def test_one_small_all_reduce_per_step_and_no_copies(tmp_path: Path) -> None:
    steps = 6
    runs = values(run_ranks(_job, 2, str(tmp_path), steps, timeout=80))
    for run in runs:
        assert run["per_step"] == [1] * steps  # exactly one collective per guarded step
        names = {name for name, _ in run["calls"]}
        assert names == {"all_reduce"}
        # one row of COLUMNS per rank (loss, checks, norm, input, fingerprint, data counts,
        # per-rank data and compute seconds): still a few floats a rank
        assert all(0 < numel <= 2 * len(COLUMNS) + 1 for _, numel in run["calls"])
        assert run["big"] == []  # no gradient-, weight- or batch-sized copy in watch/check
        assert run["same"] == [True] * steps  # the loader's own objects, not copies


def test_copy_refusing_batch_refuses() -> None:
    batch = CopyRefusingBatch(torch.zeros(1))
    with pytest.raises(AssertionError):
        copy.deepcopy(batch)
