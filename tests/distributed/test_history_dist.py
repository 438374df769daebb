"""The step history on a real 2-rank DDP run: the same records on every rank, rank 0 logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import run_ranks, values
from tg_models import TinyNet, loss_fn, make_batches

import trainguard as tg
from trainguard.runs.reached_mark import read_marks
from trainguard.step.metrics_log import metrics_path
from trainguard.testing import Fault, FaultPlan


def _worker(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    plan = FaultPlan([Fault(step=3, rank=1, where="loss")])
    with tg.Guard(model, opt, run_dir=run_dir) as guard:
        for batch in guard.watch(make_batches(6, seed=rank)):
            step = guard.state.step
            loss = plan.loss(loss_fn(model, batch), step)
            loss.backward()
            guard.step(loss)
    records = [r.bundle_fields() for r in guard.history.records()]
    return {"records": json.loads(json.dumps(tg.events.to_jsonable(records)))}


@pytest.mark.timeout(90)
def test_both_ranks_keep_the_same_history_and_only_rank_0_writes(tmp_path: Path) -> None:
    ranks = values(run_ranks(_worker, 2, str(tmp_path), timeout=80))
    rank0, rank1 = ranks[0]["records"], ranks[1]["records"]
    assert rank0 == rank1  # agreed values: the same losses, norms and decisions everywhere
    assert [r["step"] for r in rank0] == list(range(6))
    assert [r["decision"] for r in rank0] == ["ok"] * 3 + ["skip"] + ["ok"] * 2
    assert rank0[3]["losses"][1] == "nan" and rank0[3]["losses"][0] != "nan"
    assert all(len(r["losses"]) == 2 for r in rank0)
    log = metrics_path(tmp_path)
    names = sorted(p.name for p in log.parent.iterdir())  # rank 0's log and reached mark
    assert names[0] == "rank-0.jsonl" and len(names) == 2 and names[1].startswith("reached-")
    assert [m["step"] for m in read_marks(log.parent)] == [5]  # the last step rank 0 recorded
    lines = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    one_group = [{k: v for k, v in r.items() if k != "lrs"} for r in rank0]  # "lr" says it
    assert [{k: line[k] for k in one_group[0]} for line in lines] == one_group
    assert all(r["lrs"] == [r["lr"]] for r in rank0)
    history = json.loads((tmp_path / "captures" / "step-00000003" / "history.json").read_text())
    assert history["records"] == rank0[:4]
