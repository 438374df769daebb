"""A finished run's end, with ranks closing their guards at different times.

With more than two ranks only the watchers (ranks 0 and N/2) read every heartbeat. When
both have closed while the other ranks still work (a last save, a last collective of their
own), those ranks take over the reading; their first look must not take the ranks they never
read for ranks silent since the start (that ended finished 4-rank runs with exit 91 on the
non-watchers, 3 runs of 3, before the fix).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from tg_dist import run_ranks
from tg_models import TinyNet, loss_fn, make_batches
from torch.nn.parallel import DistributedDataParallel

import trainguard as tg

TIMEOUT_S = 2.0


def train_and_close_late_off_the_watchers(rank: int, world_size: int, run_dir: str) -> str:
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=TIMEOUT_S) as guard:
        for batch in guard.watch(make_batches(30, seed=rank)):
            loss = loss_fn(model, batch)
            loss.backward()
            guard.step(loss)
            time.sleep(0.1)  # the run outlasts the hang timeout
        if rank % 2:  # ranks 1 and 3: not watchers; a last save of their own
            time.sleep(TIMEOUT_S / 2)
    return "finished"


@pytest.mark.timeout(120)
def test_ranks_closing_after_the_watchers_finish_cleanly(tmp_path: Path) -> None:
    results = run_ranks(train_and_close_late_off_the_watchers, 4, str(tmp_path), timeout=100)
    assert [r.exitcode for r in results] == [0] * 4, [r.traceback for r in results]
    assert [r.value for r in results] == ["finished"] * 4
    assert not list(tmp_path.glob("hangs/*/report.json"))
    for rank in range(4):
        kinds = [e["kind"] for e in tg.read_events(tmp_path, rank)]
        assert "hang" not in kinds and kinds[-1] == "close", (rank, kinds[-3:])
