"""``examples/fast_loop.py``, a nanoGPT-style hand-written loop, under 2-rank ``torchrun``.

One launch: rank 1's data is bad at step 3 (every target -1: a 0/0 mean loss). Both ranks
skip that step and end with identical weights; the bundle replays through the CLI with the
factory in the training script itself (importing it must not train). A second launch with
``--resume`` goes on from the loop's own checkpoint: the guard's step and counters continue
from it, not from 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import free_port

import trainguard as tg

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fast_loop.py"


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _torchrun(run_dir: Path, out: Path, *args: str) -> list[dict[str, Any]]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(EXAMPLE),
        "--run-dir",
        str(run_dir),
        "--out",
        str(out),
        *args,
    ]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _same_weights(out: Path) -> None:
    states = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert states[0].keys() == states[1].keys()
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name
        assert bool(torch.isfinite(tensor).all()), name


def _bad_steps(run_dir: Path, rank: int) -> dict[int, set[str]]:
    """Per step, the kinds of the events that say it went bad, on one rank."""
    steps: dict[int, set[str]] = {}
    for event in tg.read_events(run_dir, rank):
        if event["kind"] in ("nonfinite", "skip"):
            steps.setdefault(event["step"], set()).add(event["kind"])
    return steps


@pytest.mark.timeout(240)
def test_fast_loop_skips_together_replays_and_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ranks = _torchrun(run_dir, tmp_path / "out1", "--steps", "8", "--poison-step", "3",
                      "--poison-rank", "1")  # fmt: skip

    # The same skip on both ranks, read from each rank's own events.
    for rank in range(2):
        assert _bad_steps(run_dir, rank) == {3: {"nonfinite", "skip"}}, rank
        nonfinite = [e for e in tg.read_events(run_dir, rank) if e["kind"] == "nonfinite"]
        assert nonfinite[0]["ranks"] == [1] and nonfinite[0]["where"] == "loss"
    assert [r["global_step"] for r in ranks] == [8, 8]
    assert ranks[0]["state"] == ranks[1]["state"]
    assert ranks[0]["state"]["nonfinite_steps"] == [3]
    _same_weights(tmp_path / "out1")

    # The bundle replays with the factory in the training script, from a folder of its own:
    # importing the script must not train (it would write runs/fast_loop there).
    bundle = run_dir / "captures" / "step-00000003"
    replay_cwd = tmp_path / "replay_cwd"
    replay_cwd.mkdir()
    replay_cmd = [sys.executable, "-m", "trainguard", "replay", str(bundle), "--factory",
                  f"{EXAMPLE}:make_replay", "--repeats", "1", "--json"]  # fmt: skip
    started = time.monotonic()
    replay = subprocess.Popen(
        replay_cmd, cwd=replay_cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        # Meanwhile: resume from the loop's own checkpoint (ckpt.pt at iter_num 8) and go on
        # to step 12, with a bad batch on rank 0 at step 10.
        ranks = _torchrun(run_dir, tmp_path / "out2", "--resume", "--steps", "12",
                          "--poison-step", "10", "--poison-rank", "0")  # fmt: skip
        stdout, stderr = replay.communicate(timeout=120)
    finally:
        replay.kill()  # a no-op once it has ended
    seconds = time.monotonic() - started
    assert replay.returncode == 1, stderr[-3000:]  # 1: reproduced (a finding)
    report = json.loads(stdout)
    assert report["reproduced"] and report["rank"] == 1, report["summary"]
    assert report["phase"] == "forward" and report["op"] == "aten.nll_loss_forward"
    assert report["verdict"] == "batch_statistics", report["summary"]
    assert list(replay_cwd.iterdir()) == [], list(replay_cwd.iterdir())  # nothing trained
    assert seconds < 90, seconds

    for rank in range(2):
        assert _bad_steps(run_dir, rank) == {3: {"nonfinite", "skip"}, 10: {"nonfinite", "skip"}}
    assert [r["global_step"] for r in ranks] == [12, 12]
    state = ranks[0]["state"]
    assert ranks[1]["state"] == state
    assert state["nonfinite_steps"] == [3, 10] and state["total_nonfinite"] == 2
    assert state["last_good_step"] == 11
    _same_weights(tmp_path / "out2")
    # The resumed launch goes on with the same run (GuardConfig.run="continue") ...
    assert len({e["run"] for e in tg.read_events(run_dir)}) == 1
    # ... and its first checked step is 8, the checkpoint's, not 0.
    metrics = [json.loads(line) for line in (run_dir / "metrics" / "rank-0.jsonl").open()]
    assert [m["step"] for m in metrics] == list(range(12)), [m["step"] for m in metrics]
