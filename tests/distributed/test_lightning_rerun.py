"""``TrainGuard(rerun=True)`` under a real 2-process Lightning Trainer (CPU, gloo).

One launch of ``scripts/lightning_rerun.py`` fits 4 times in the same process group: under
``strategy="ddp"`` and FSDP2 (``ModelParallelStrategy``), each without and with a one-off
NaN (a forward hook on rank 1 poisons one output once at step 1); every run also holds a
NaN sample on rank 0 at step 4. The model has BatchNorm and dropout and the Trainer
accumulates 2 micro-batches.

Properties: the one-off fault is rerun on both ranks (``transient``) and the step counts; the
NaN sample is rerun, still bad (``persistent``) and skipped on both ranks; the run with the
one-off fault ends bit-identical to the run without it on each rank: weights, BatchNorm
statistics, and the RNG stream (dropout drew the same masks). That needs the rerun to go
through the DDP wrapper (through the inner module the gradients are not all-reduced: the
ranks' weights differ) and the first micro-batch in Lightning's ``no_sync`` (else the sum
rounds differently). The parameters are identical across ranks; the BatchNorm statistics
are each rank's own (DDP broadcasts rank 0's at the start of each forward only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch
from tg_dist import free_port

SCRIPT = Path(__file__).resolve().parent / "scripts" / "lightning_rerun.py"
STRATEGIES = ("ddp", "fsdp2")


def _launch(tmp_path: Path) -> list[dict[str, Any]]:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env["MASTER_PORT"] = str(free_port())  # not one from the ephemeral range (tg_dist)
    env.pop("LOCAL_RANK", None)
    command = [sys.executable, str(SCRIPT), "--run-dir", str(run_dir), "--out", str(out)]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=150, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    lines = (run_dir / "events" / f"rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _reruns(run_dir: Path, rank: int) -> list[tuple[int, str, list[int]]]:
    return [
        (e["step"], e["verdict"], e["ranks"])
        for e in _events(run_dir, rank)
        if e["kind"] == "rerun"
    ]


def _skips(run_dir: Path, rank: int) -> list[int]:
    return [e["step"] for e in _events(run_dir, rank) if e["kind"] == "skip"]


@pytest.mark.timeout(180)
def test_ddp_and_fsdp2_rerun_a_one_off_fault_and_skip_a_nan_sample(tmp_path: Path) -> None:
    ranks = _launch(tmp_path)
    for name in STRATEGIES:
        base = tmp_path / "run" / name
        for rank, result in enumerate(ranks):
            clean, fault = result[f"{name}/clean"], result[f"{name}/fault"]
            where = f"{name} rank {rank}"
            assert clean["global_step"] == fault["global_step"] == 6, where
            assert _reruns(base / "fault", rank) == [(1, "transient", [1]), (4, "persistent", [0])]
            assert _reruns(base / "clean", rank) == [(4, "persistent", [0])], where
            assert _skips(base / "fault", rank) == _skips(base / "clean", rank) == [4], where
            assert fault["guard"]["nonfinite_steps"] == [4], where  # step 1 counted as good
            assert fault["guard"]["total_nonfinite"] == 1, where
            for key, want in clean["state"].items():  # weights and BatchNorm statistics
                assert torch.equal(fault["state"][key], want), f"{where}: {key}"
            assert torch.equal(fault["rng"], clean["rng"]), where  # the same dropout stream
        first, second = (r[f"{name}/fault"]["state"] for r in ranks)
        for key, value in first.items():
            if "running_" not in key:  # BatchNorm statistics are each rank's own
                assert torch.equal(value, second[key]), f"{name}: {key} differs across ranks"
