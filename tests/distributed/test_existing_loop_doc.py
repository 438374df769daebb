"""docs/existing-loop.md's diff is the real one: it applies to a nanoGPT-shaped script
(tests/support/nanogpt_shaped/train.py: a flat script in nanoGPT's structure), changes the
number of lines the page says, and the patched script runs: bit for bit the bare script's
training when nothing goes wrong, resumed from a checkpoint saved before the guard existed
(its step and its LR schedule go on), a NaN skipped on every rank of a 2-rank DDP job, its
capture holding every rank's micro-batches without a ``record_batch`` line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tg_dist import torchrun_command, torchrun_env

import trainguard as tg

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "existing-loop.md"
SCRIPT = ROOT / "tests" / "support" / "nanogpt_shaped"

pytestmark = pytest.mark.timeout(180)


def _diff() -> str:
    """The page's first ``diff`` block (section 2)."""
    match = re.search(r"```diff\n(.*?)```", DOC.read_text(), re.S)
    assert match, "docs/existing-loop.md has no diff block"
    return match.group(1)


def _patched(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name in ("train.py", "model.py"):
        shutil.copy(SCRIPT / name, folder / name)
    if shutil.which("patch"):
        tool = ["patch", "-p1", "--no-backup-if-mismatch"]
    elif shutil.which("git"):
        tool = ["git", "apply", "-p1", "-"]  # outside a repository: applies to the folder
    else:
        pytest.skip("needs patch or git to apply the page's diff")
    done = subprocess.run(
        tool,
        input=_diff(),
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return folder


def _run(folder: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    done = subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        env=env or torchrun_env(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [line for line in done.stdout.splitlines() if line.startswith("iter ")]


def _events(run_dir: Path, rank: int = 0) -> list[dict[str, object]]:
    lines = (run_dir / "events" / f"rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_the_page_states_the_count_of_changed_lines() -> None:
    changed = [
        line
        for line in _diff().splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    stated = re.search(r"(\d+) changed lines", DOC.read_text())
    assert stated and int(stated.group(1)) == len(changed) <= 10


def test_the_patched_script_trains_as_the_bare_one_and_resumes_a_pre_guard_checkpoint(
    tmp_path: Path,
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("train.py", "model.py"):
        shutil.copy(SCRIPT / name, bare / name)
    guarded = _patched(tmp_path / "guarded")
    bare_lines = _run(bare, "--max_iters=12")
    assert _run(guarded, "--max_iters=12") == bare_lines  # the same losses, bit for bit
    saved = [torch.load(f / "out" / "ckpt.pt") for f in (bare, guarded)]
    assert saved[1]["guard"]["state"]["step"] == 10
    for name, value in saved[0]["model"].items():
        assert torch.equal(value, saved[1]["model"][name]), name

    # the bare script's checkpoint (no "guard" in it) resumed by the patched script
    shutil.copy(bare / "out" / "ckpt.pt", guarded / "out" / "ckpt.pt")
    shutil.rmtree(guarded / "out" / "events")
    resumed = _run(guarded, "--init_from=resume", "--max_iters=16", "--poison_iter=13")
    assert [line.split(":")[0] for line in resumed] == [f"iter {i}" for i in range(10, 17)]
    lrs = [line.split(", ")[-1] for line in resumed[:3]]
    assert lrs == [line.split(", ")[-1] for line in bare_lines[10:13]]  # the LR schedule goes on
    kinds = [(e["step"], e["kind"]) for e in _events(guarded / "out")]
    assert (10, "state_loaded") in kinds and (13, "skip") in kinds
    assert [s for s, k in kinds if k == "nonfinite"] == [13]


def test_the_patched_script_skips_a_nan_on_every_rank_of_a_ddp_job(tmp_path: Path) -> None:
    guarded = _patched(tmp_path / "guarded")
    command = torchrun_command(guarded / "train.py", "--max_iters=8", "--poison_iter=5")
    done = subprocess.run(
        command, cwd=guarded, capture_output=True, text=True, timeout=150, env=torchrun_env()
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for rank in (0, 1):
        skipped = [e["step"] for e in _events(guarded / "out", rank) if e["kind"] == "skip"]
        assert skipped == [5], rank
    bundle = tg.load_bundle(guarded / "out" / "captures" / "step-00000005")
    for rank in (0, 1):  # no record_batch in the diff: the model's call arguments, (X, Y)
        micro = bundle.batches(rank)
        assert micro and all(len(batch) == 2 for batch in micro), rank
        assert all(x.dtype == torch.int64 and x.shape == y.shape for x, y in micro), rank
