"""Diagnosis of captured bundles: divergence from the bundle's history, inspect's history,
and a fault that keeps hitting one rank."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import nan_cases as nc
import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.capture.inspect import inspect_bundle
from trainguard.replay.render import inspect_text

pytestmark = pytest.mark.timeout(60)


def _diverging_bundle(run_dir: Path) -> Path:
    """A guarded run with too high a learning rate, until its first capture."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(nc.D, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.6)
    gen = torch.Generator().manual_seed(13)
    data = []
    for _ in range(200):
        x = torch.randn(nc.BATCH, nc.D, generator=gen) * 3
        data.append((x, x.sum(-1, keepdim=True)))
    captures = run_dir / "captures"
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=0) as guard:
        for batch in guard.watch(data):
            loss = nc.mse(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            if guard.check(loss):
                optimizer.step()
            optimizer.zero_grad()
            if captures.exists() and any(captures.glob("step-*")):
                break
    (bundle,) = sorted(captures.glob("step-*"))
    return bundle


def _regression_factory() -> tuple[nn.Module, Any]:
    return nn.Sequential(nn.Linear(nc.D, 1)), nc.mse


@pytest.fixture(scope="module")
def diverged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _diverging_bundle(tmp_path_factory.mktemp("diverged"))


def test_replay_calls_a_diverged_run_divergence_from_the_bundle_history(diverged: Path) -> None:
    bundle = tg.load_bundle(diverged)
    assert bundle.history is not None and bundle.history[-1]["step"] == bundle.step
    r = tg.replay(diverged, _regression_factory).to_dict()
    assert (r["reproduced"], r["verdict"]) == (True, "divergence")
    assert r["growth"]["factor"] > 1e6 and r["growth"]["steps"] >= 10
    assert r["summary"].startswith("The run diverged: the ")
    assert "learning rate" in r["advice"]


def test_without_history_the_weights_still_say_divergence(diverged: Path, tmp_path: Path) -> None:
    """No history.json (no growth, no learning rate to read): the weights before the step,
    far past any trained model's, still say the updates ran away (issue 53: it said
    ``numerical`` then)."""
    copy = tmp_path / diverged.name
    shutil.copytree(diverged, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["files"]["history.json"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    (copy / "history.json").unlink()
    assert tg.load_bundle(copy).history is None
    r = tg.replay(copy, _regression_factory).to_dict()
    assert r["verdict"] == "divergence" and "growth" not in r
    assert r["summary"].startswith("The run diverged: the weights reached |w| = ")
    assert r["runaway"]["lr"] is None and r["runaway"]["largest_weight"] >= 1e4
    assert "history   not captured" in inspect_text(inspect_bundle(copy))


def test_inspect_shows_the_history(diverged: Path) -> None:
    summary = inspect_bundle(diverged)
    history = summary["history"]
    assert history["last_step"] == summary["step"] and history["decisions"]["skip"] == 1
    text = inspect_text(summary)
    assert f"history   {history['steps']} steps (0..{summary['step']})" in text
    assert f"  step {summary['step']}: loss inf, grad norm inf, skip" in text


def test_a_fault_that_recurs_on_one_rank_points_at_its_host(tmp_path: Path) -> None:
    import tg_capture_models as models

    from trainguard.testing import Fault, FaultPlan

    data = models.batches("clean", 5, bad_step=-1)
    for step in (1, 3):  # the job restarted in the same run dir; the fault came back
        plan = FaultPlan([Fault(step=step, where="grad")])
        models.train(models.make_model("clean"), models.ce_loss, data, tmp_path, plan=plan)
    bundles = sorted((tmp_path / "captures").glob("step-*"))
    assert len(bundles) == 2
    r = tg.replay(bundles[-1], models.clean_factory)
    assert r.verdict == "not_reproduced" and "test that GPU or node" in r.advice
    host = tg.load_bundle(bundles[-1]).meta(0)["env"]["host"]
    assert f"rank 0 on host {host} in 2 of the run's 2 captures" in r.summary
