"""A non-finite hyper-parameter is caught before the optimizer step (issue 55).

A scheduler that yields a NaN learning rate for one param group at one step (a warm-up
divided by zero) made that update write NaN into that group's weights, and only the next
step's forward failed. Now the step itself is bad: skipped on every rank before the update,
the event and the bundle name the group and the option; every group's learning rate is in
the history.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.step.hyperparams import nonfinite_hyperparameters, row_lr

BAD_STEP = 3


def _groups(model: nn.Sequential, fused: bool = False) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 1e-2},
            {"params": model[2].parameters(), "lr": 1e-3},
        ],
        fused=fused,
    )


def _run(run_dir: Path, sync_free: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = _groups(model, fused=sync_free)
    data = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    before: dict[int, list[torch.Tensor]] = {}
    oks = []
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0) as guard:
        for x in guard.watch(data):
            step = guard.global_step
            opt.param_groups[1]["lr"] = math.nan if step == BAD_STEP else 1e-3  # the scheduler
            before[step] = [p.detach().clone() for p in model.parameters()]
            loss = model(x).pow(2).mean()
            loss.backward()
            if sync_free:
                oks.append(bool(guard.step(loss)))
            else:
                oks.append(guard.check(loss))
                opt.step()
                opt.zero_grad()
    after = [p.detach().clone() for p in model.parameters()]
    events = tg.read_events(run_dir, 0)
    return {"oks": oks, "before": before, "after": after, "events": events, "model": model}


@pytest.mark.parametrize("sync_free", [False, True], ids=["check", "sync_free"])
def test_a_nan_learning_rate_of_one_group_is_a_bad_step_skipped_before_the_update(
    tmp_path: Path, sync_free: bool
) -> None:
    run = _run(tmp_path, sync_free)
    assert run["oks"] == [True, True, True, False, True, True]
    assert all(torch.isfinite(p).all() for p in run["after"])  # never written into the weights
    for mine, then in zip(run["before"][BAD_STEP + 1], run["before"][BAD_STEP], strict=True):
        assert torch.equal(mine, then)  # the bad step's update left out, every group's
    (bad,) = [e for e in run["events"] if e["kind"] == "nonfinite"]
    assert (bad["step"], bad["where"], bad["ranks"]) == (BAD_STEP, "hyperparameter", [0])
    assert bad["hyperparameters"] == [{"group": 1, "name": "lr", "value": "nan"}]
    assert [e["step"] for e in run["events"] if e["kind"] == "skip"] == [BAD_STEP]
    (bundle_path,) = (tmp_path / "captures").glob("step-*")
    bundle = tg.load_bundle(bundle_path)
    assert bundle.trigger == "hyperparameter"
    meta = json.loads((bundle_path / "rank-0" / "meta.json").read_text())
    assert meta["hyperparameters"] == [{"group": 1, "name": "lr", "value": "nan"}]
    history = json.loads((bundle_path / "history.json").read_text())["records"]
    assert [r["lrs"] for r in history][:2] == [[1e-2, 1e-3], [1e-2, 1e-3]]
    assert history[-1]["step"] == BAD_STEP and history[-1]["lrs"] == [1e-2, "nan"]


def test_every_scalar_hyper_parameter_is_looked_at() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.9, 0.999), weight_decay=0.01)
    assert row_lr(opt) == 0.1 and nonfinite_hyperparameters(opt) == []
    opt.param_groups[0]["betas"] = (0.9, math.inf)
    opt.param_groups[0]["weight_decay"] = -math.inf
    assert math.isnan(row_lr(opt))
    found = nonfinite_hyperparameters(opt)
    assert {(h["group"], h["name"]) for h in found} == {(0, "betas[1]"), (0, "weight_decay")}
    opt.param_groups[0]["betas"], opt.param_groups[0]["weight_decay"] = (0.9, 0.999), 0.0
    opt.param_groups[0]["lr"] = torch.tensor(0.1)  # a CPU tensor LR: a host number
    assert row_lr(opt) == float(torch.tensor(0.1)) and nonfinite_hyperparameters(opt) == []
    opt.param_groups[0]["lr"] = torch.tensor(math.nan)  # read alike: a NaN one is found
    assert math.isnan(row_lr(opt))
    assert [(h["group"], h["name"]) for h in nonfinite_hyperparameters(opt)] == [(0, "lr")]
    opt.param_groups[0]["lr"] = torch.tensor(0.1, device="meta")  # a device one: not read
    assert row_lr(opt) == 0.0 and nonfinite_hyperparameters(opt) == []
