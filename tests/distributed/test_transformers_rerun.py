"""``TrainGuardCallback(rerun=True)`` on 2 DDP processes under ``torchrun`` (gloo on CPU).

One launch of ``scripts/hf_rerun.py`` trains a tiny GPT-2 (dropout on, two micro-batches a
step) twice: without and with a one-off NaN on rank 1 at step 1; both runs poison every
forward of step 3 on rank 0. The one-off fault is rerun through the Trainer's
``training_step`` on the DDP-wrapped model (``transient``: the step counts), step 3 is rerun,
still bad (``persistent``) and skipped on both ranks, and the faulted run ends bit-identical
to the clean one on both ranks. A rerun on the inner model (no all-reduce) fails this: each
rank keeps its own gradients and the weights differ across ranks and from the clean run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tg_dist import free_port

import trainguard as tg

SCRIPT = Path(__file__).resolve().parent / "scripts" / "hf_rerun.py"


def _launch(tmp_path: Path) -> list[dict[str, Any]]:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(SCRIPT),
        "--run-dir",
        str(run_dir),
        "--out",
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _events(run_dir: Path, rank: int, kind: str) -> list[dict[str, Any]]:
    return [e for e in tg.read_events(run_dir, rank) if e["kind"] == kind]


@pytest.mark.timeout(180)
def test_a_one_off_nan_is_rerun_on_both_ranks_and_costs_nothing(tmp_path: Path) -> None:
    ranks = _launch(tmp_path)
    digests = set()
    for rank, result in enumerate(ranks):
        clean, fault = result["clean"], result["fault"]
        assert clean["global_step"] == fault["global_step"] == 4
        reruns = _events(tmp_path / "run" / "fault", rank, "rerun")
        assert [(e["step"], e["verdict"], e["ranks"]) for e in reruns] == [
            (1, "transient", [1]),
            (3, "persistent", [0]),
        ]
        skips = [e["step"] for e in _events(tmp_path / "run" / "fault", rank, "skip")]
        assert skips == [3]
        assert fault["state"]["nonfinite_steps"] == clean["state"]["nonfinite_steps"] == [3]
        assert fault["weights_sha256"] == clean["weights_sha256"], rank
        digests.add(fault["weights_sha256"])
    assert len(digests) == 1  # the same weights on both ranks
