"""The HF Trainer integration with a real ``Trainer`` on a tiny GPT-2 (from GPT2Config).

One sample of the data has every label set to -100, and batches hold one sample: that
batch's mean loss is 0/0 = NaN. The run is ``examples/hf_trainer.py``, in one process and
in two under ``torchrun`` (gloo on CPU). Cross-rank properties: every rank skips the same
step (the same counters), the weights end identical and finite, and the bundle replays with
the loss named as the phase.
"""

from __future__ import annotations

import importlib.util
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

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
FAST_EXIT = Path(__file__).resolve().parent / "scripts" / "fast_exit.py"


def _run(tmp_path: Path, world: int) -> tuple[list[dict[str, Any]], Path]:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launcher = [sys.executable]
    if world > 1:
        launcher += [
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={world}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        ]
    script = [str(FAST_EXIT), str(EXAMPLE)]  # the example, ended before PyTorch's exit race
    command = [*launcher, *script, "--run-dir", str(run_dir), "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return ranks, run_dir


def _replay(bundle: Path) -> tg.ReplayReport:
    spec = importlib.util.spec_from_file_location("tg_hf_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tg.replay(bundle, module.make_replay, repeats=1)


def _check_run(ranks: list[dict[str, Any]], run_dir: Path, steps: int) -> None:
    first = ranks[0]
    assert {r["global_step"] for r in ranks} == {steps}
    assert all(r["state"] == first["state"] for r in ranks)  # the same decision everywhere
    assert first["state"]["total_nonfinite"] == 1
    bad_step = first["state"]["nonfinite_steps"][0]
    for rank in range(len(ranks)):
        kinds = [e["kind"] for e in tg.read_events(run_dir, rank) if e["step"] == bad_step]
        assert "nonfinite" in kinds and "skip" in kinds, (rank, kinds)
    assert len({r["weights_sha256"] for r in ranks}) == 1  # identical weights on every rank
    assert all(r["weights_finite"] for r in ranks)
    bundles = sorted((run_dir / "captures").glob("step-*"))
    assert [b.name for b in bundles] == [f"step-{bad_step:08d}"]
    report = _replay(bundles[0])
    assert report.reproduced and report.phase == "loss", report.summary
    assert report.verdict == "batch_statistics"  # 0/0: no single sample, the batch as a whole


@pytest.mark.timeout(120)
def test_one_process_skips_the_fully_masked_batch(tmp_path: Path) -> None:
    ranks, run_dir = _run(tmp_path, world=1)
    _check_run(ranks, run_dir, steps=16)


@pytest.mark.timeout(180)
def test_torchrun_two_processes_skip_together(tmp_path: Path) -> None:
    ranks, run_dir = _run(tmp_path, world=2)
    _check_run(ranks, run_dir, steps=8)  # 16 samples over 2 ranks, batches of one
