"""The loop hands the guard what a replay factory needs (issue 53): ``factory_config`` is
written into every bundle and passed to a factory that takes an argument, so the model's
configuration is not smuggled in through environment variables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import trainguard as tg


class Net(nn.Module):
    """A model whose shape comes from its configuration (nanoGPT's ``model_args``)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.layers(torch.log(x.abs())))  # log(0) on a zero row
        return out


def loss_fn(model: nn.Module, batch: Tensor) -> Tensor:
    out: Tensor = model(batch).pow(2).mean()
    return out


CONFIG = {"width": 6, "depth": 2}


def make_replay(config: dict[str, Any]) -> tuple[nn.Module, Any]:
    return Net(config["width"], config["depth"]), loss_fn


def make_default() -> tuple[nn.Module, Any]:
    return Net(6, 2), loss_fn


def _bundle(run_dir: Path, factory_config: dict[str, Any] | None) -> Path:
    torch.manual_seed(0)
    model = Net(**CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    batches[1][2] = 0.0  # sample 2 of step 1: log(0)
    options = {} if factory_config is None else {"factory_config": factory_config}
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0, **options) as guard:
        for batch in guard.watch(batches):
            loss = loss_fn(model, batch)
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    (bundle,) = (run_dir / "captures").glob("step-*")
    return bundle


def test_the_loops_config_reaches_the_factory_through_the_bundle(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path, CONFIG)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["factory_config"] == CONFIG
    assert tg.load_bundle(bundle).factory_config == CONFIG
    report = tg.replay(bundle, make_replay).to_dict()
    assert report["reproduced"] and report["phase"] == "forward"
    assert report["culprit_samples"] == [{"micro_batch": 0, "position": 2, "index": None}]
    # a factory of no argument is called as before
    assert tg.replay(bundle, make_default).to_dict()["reproduced"]


def test_a_factory_that_wants_a_config_the_run_did_not_give_says_so(tmp_path: Path) -> None:
    bundle = _bundle(tmp_path, None)
    assert tg.load_bundle(bundle).factory_config is None
    with pytest.raises(tg.ReplayError, match="factory_config"):
        tg.replay(bundle, make_replay)


def test_the_config_must_be_json_able() -> None:
    with pytest.raises(tg.ConfigError, match="factory_config"):
        tg.GuardConfig(factory_config={"width": object()})  # type: ignore[dict-item]
