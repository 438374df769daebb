"""A loss one rank did not see is no rank's loss: the row's ``loss_unknown`` column.

``trainguard run`` checks a step with the losses it saw computed from the model's output,
and with the gradients alone (``check_gradients``) where it saw none; so in one step one
rank may hand its loss over and another not. Real processes (gloo, 2 ranks, DDP): rank 1
checks steps 15-19 without a loss while rank 0 checks with its loss, inflated x1000 at step
17; at step 25 both hand theirs over, rank 0's inflated again. Every rank must record the
same steps alike (no loss at all in 15-19, not rank 0's beside a made-up 0.0), the spike
rule must read no loss in 15-19 (else it would judge the mean of rank 0's inflated loss and
rank 1's 0.0), and judge step 25's spike on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import run_ranks, values
from tg_models import TinyNet
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg

STEPS = 30
UNSEEN = range(15, 20)
"""Steps rank 1 checks without its loss."""
INFLATED = (17, 25)
"""Steps whose loss rank 0 hands over x1000 (its gradients as usual)."""


def _train(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    config = tg.GuardConfig(run_dir=Path(run_dir), hang_timeout=0, spikes=tg.SpikeConfig(warmup=8))
    guard = tg.Guard(model, opt, config=config)
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        loss = (model(torch.randn(6, 8, generator=gen)) - 1.0).pow(2).mean()
        loss.backward()
        if rank == 1 and step in UNSEEN:
            ok = guard.check_gradients()
        else:
            ok = guard.check(loss * 1000 if rank == 0 and step in INFLATED else loss)
        if ok:
            opt.step()
        opt.zero_grad()
    guard.close()
    events = (Path(run_dir) / "events" / f"rank-{rank}.jsonl").read_text().splitlines()
    spikes = [(e["step"], e["metric"]) for e in map(json.loads, events) if e["kind"] == "spike"]
    records = [(r.step, r.decision, len(r.losses)) for r in guard.history.records()]
    return {"records": records, "spikes": spikes}


@pytest.mark.timeout(120)
def test_a_loss_one_rank_did_not_see_is_no_ranks_loss(tmp_path: Path) -> None:
    ranks = values(run_ranks(_train, 2, str(tmp_path), timeout=100))
    assert ranks[0] == ranks[1]  # every rank records and judges alike
    records = ranks[0]["records"]
    assert [step for step, _, count in records if count == 0] == list(UNSEEN)
    assert all(count == 2 for step, _, count in records if step not in UNSEEN)  # per rank
    assert ranks[0]["spikes"] == [(25, "loss")]  # none at 17: no loss was known there
