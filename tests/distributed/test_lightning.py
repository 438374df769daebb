"""The Lightning callback under a real ``Trainer(strategy="ddp", devices=2, accelerator="cpu")``.

Lightning's DDP launcher re-runs the script it was started from for every other rank, so
the run is ``examples/lightning_ddp.py`` started as a subprocess (under pytest the launcher
would re-run pytest itself; ``ddp_spawn`` would pickle the test module). Sample 27 of the
data is 1e30: on rank 1 its squared error overflows, the reduced gradients are NaN on both
ranks. Cross-rank properties: both ranks skip the same step (the same counters), end with
identical finite weights, and the bundle replays to the loss.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

from tg_dist import free_port

import trainguard as tg

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_ddp.py"
FAST_EXIT = Path(__file__).resolve().parent / "scripts" / "fast_exit.py"
"""Runs the example, then exits before PyTorch's gloo exit race (fast_exit.py says why: it
aborted the FSDP2 run's rank 0 once, 'terminate called without an active exception')."""


def _run(tmp_path: Path, *flags: str) -> tuple[list[dict[str, Any]], Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env["MASTER_PORT"] = str(free_port())  # not one from the ephemeral range (tg_dist)
    env.pop("LOCAL_RANK", None)
    command = [sys.executable, str(FAST_EXIT), str(EXAMPLE), "--run-dir", str(run_dir)]
    command += ["--out", str(out)]
    done = subprocess.run(
        [*command, *flags], env=env, capture_output=True, text=True, timeout=150, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return ranks, run_dir


def _replay(bundle: Path) -> tg.ReplayReport:
    spec = importlib.util.spec_from_file_location("tg_lightning_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tg.replay(bundle, module.make_replay, repeats=1, bisect=False)


def _check_run(ranks: list[dict[str, Any]], run_dir: Path, steps: int) -> None:
    first, second = ranks
    assert first["global_step"] == second["global_step"] == steps
    # the same decision on both ranks: one bad step, skipped, counted the same way
    assert first["state"] == second["state"]
    assert first["state"]["total_nonfinite"] == 1
    assert len(first["state"]["nonfinite_steps"]) == 1
    bad_step = first["state"]["nonfinite_steps"][0]
    for rank in (0, 1):
        kinds = [e["kind"] for e in tg.read_events(run_dir, rank) if e["step"] == bad_step]
        assert "nonfinite" in kinds and "skip" in kinds, (rank, kinds)
    # identical, finite weights: the NaN gradients never reached the optimizer on any rank
    assert first["params"] == second["params"]
    assert all(math.isfinite(v) for values in first["params"].values() for v in values)
    bundles = sorted((run_dir / "captures").glob("step-*"))
    assert [b.name for b in bundles] == [f"step-{bad_step:08d}"]
    report = _replay(bundles[0])
    assert report.reproduced and report.phase == "loss", report.summary
    assert report.details["rank"] == 1


@pytest.mark.timeout(180)
def test_ddp_two_ranks_skip_the_same_step(tmp_path: Path) -> None:
    ranks, run_dir = _run(tmp_path)
    _check_run(ranks, run_dir, steps=8)  # 32 samples per rank, batches of 4
    validation = [
        e for e in tg.read_events(run_dir, 0) if e["kind"] == "phase" and e["phase"] == "validation"
    ]
    assert [e["state"] for e in validation] == ["enter", "exit"]


@pytest.mark.timeout(180)
def test_ddp_with_gradient_accumulation(tmp_path: Path) -> None:
    ranks, run_dir = _run(tmp_path, "--accumulate", "2")
    _check_run(ranks, run_dir, steps=4)
    bundle = next((run_dir / "captures").glob("step-*"))
    meta = json.loads((bundle / "rank-1" / "meta.json").read_text())
    assert len(meta["micro_losses"]) == 2  # the whole accumulation window was captured


@pytest.mark.timeout(180)
def test_ddp_bf16_mixed(tmp_path: Path) -> None:
    ranks, run_dir = _run(tmp_path, "--precision", "bf16-mixed")
    _check_run(ranks, run_dir, steps=8)


@pytest.mark.timeout(180)
def test_ddp_spawn(tmp_path: Path) -> None:
    """ddp_spawn: the guard runs in the spawned processes; only rank 0's weights come back,
    so the cross-rank check reads both ranks' events."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env["MASTER_PORT"] = str(free_port())  # not one from the ephemeral range (tg_dist)
    command = [sys.executable, str(FAST_EXIT), str(EXAMPLE), "--run-dir", str(run_dir)]
    command += ["--out", str(out)]
    done = subprocess.run(
        [*command, "--strategy", "ddp_spawn"],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    skips = [
        [e["step"] for e in tg.read_events(run_dir, rank) if e["kind"] == "skip"] for rank in (0, 1)
    ]
    assert skips[0] == skips[1] and len(skips[0]) == 1
    result = json.loads((out / "rank0.json").read_text())
    assert all(math.isfinite(v) for values in result["params"].values() for v in values)
    bundle = run_dir / "captures" / f"step-{skips[0][0]:08d}"
    assert _replay(bundle).phase == "loss"


@pytest.mark.timeout(180)
def test_fsdp2_model_parallel_strategy(tmp_path: Path) -> None:
    """FSDP2 under Lightning (``ModelParallelStrategy`` + ``fully_shard`` in
    ``configure_model``): the gradients are DTensor shards. Both ranks skip the same step,
    the gathered weights are identical and finite, and the bundle (weights saved with DCP)
    replays to the loss on rank 1. Against the same run under DDP: the guard's global
    gradient norm (combined from the shards' norms) is DDP's at every good step, and the
    final weights match."""
    ranks, run_dir = _run(tmp_path / "fsdp2", "--strategy", "fsdp2")
    _check_run(ranks, run_dir, steps=8)
    bundle = tg.load_bundle(next((run_dir / "captures").glob("step-*")))
    assert bundle.sharded  # the model really was FSDP2-sharded: weights saved with DCP
    assert "dcp/.metadata" in bundle.files
    ddp_ranks, ddp_dir = _run(tmp_path / "ddp")
    sharded_norms, ddp_norms = _grad_norms(run_dir), _grad_norms(ddp_dir)
    assert sharded_norms.keys() == ddp_norms.keys() and len(sharded_norms) == 7  # 8 - 1 bad
    for step, norm in ddp_norms.items():
        assert sharded_norms[step] == pytest.approx(norm, rel=1e-5), step
    for name, values in ddp_ranks[0]["params"].items():
        assert ranks[0]["params"][name] == pytest.approx(values, rel=1e-4, abs=1e-6), name


def _grad_norms(run_dir: Path) -> dict[int, float]:
    """The agreed global gradient norm of each good step (rank 0's metrics log)."""
    lines = (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r["grad_norm"] for r in records if r["decision"] == "ok"}
