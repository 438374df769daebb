"""``trainguard run`` stands aside on every rank together (``attach/leaving.py``): a reason
one rank finds alone (a probe's optimizer of rank 0's own; rank 1 finding no model at attach)
is agreed, and the job ends as the bare script's, bit for bit. Standing aside inside an
optimizer step hook leaves the script's own process-wide step hooks working."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tg_run import assert_same, guarded, launch, run

import trainguard as tg


def _aside_steps(run_dir: Path, ranks: int) -> list[list[int]]:
    return [
        [int(e["step"]) for e in tg.read_events(run_dir, rank) if e["kind"] == "stand_aside"]
        for rank in range(ranks)
    ]


def _as_bare_two_ranks(tmp_path: Path, *args: str) -> str:
    """The 2-rank script bare and under ``trainguard run``: both end with 0 and every rank's
    weights and optimizer state are bit-identical; the guarded run's stderr."""
    bare = run([*launch(2, bare=True), "--out", str(tmp_path / "bare"), *args])
    assert bare.returncode == 0, bare.stderr[-3000:]
    cmd = [*guarded(tmp_path / "run"), "--", *launch(2), "--out", str(tmp_path / "out")]
    done = run([*cmd, *args])
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same(tmp_path / "bare", tmp_path / "out", 2)
    return done.stderr


def test_standing_aside_inside_a_step_leaves_the_scripts_own_step_hooks_working(
    tmp_path: Path,
) -> None:
    """The script's own process-wide optimizer step hooks (a profiler's) come after
    trainguard's. Standing aside inside trainguard's hook deleted it from the dict torch was
    iterating: the script's step ended with "OrderedDict mutated during iteration". Now the
    hook is made inert there, and the script's hooks see every step."""
    cmd = [*guarded(tmp_path / "run"), "--", *launch(1), "--out", str(tmp_path / "out")]
    done = run([*cmd, "--second-optimizer", "--global-step-hooks", "--steps", "4"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not guarding: a second optimizer (SGD) steps besides the guarded AdamW" in done.stderr
    hooked = torch.load(tmp_path / "out" / "rank0.pt")["hooked"]
    assert hooked == {"pre": 4 + 2, "post": 4 + 2}  # 4 steps, and the second's from step 2


@pytest.mark.timeout(200)
def test_a_second_optimizer_on_one_rank_makes_every_rank_stand_aside_at_one_step(
    tmp_path: Path,
) -> None:
    """Rank 0 alone trains a probe with an optimizer of its own (from step 2). It stood aside
    alone and left the guard's all-reduce, where rank 1 waited: gloo aborted both ranks with a
    collective mismatch, a job the bare script ends. Now rank 0 says so in its next check's
    row, and both ranks stand aside after that step (attach/leaving.py): the job ends as the
    bare one, bit for bit."""
    stderr = _as_bare_two_ranks(tmp_path, "--probe-rank", "0", "--steps", "6")
    assert "rank 0: not guarding: a second optimizer (SGD) steps besides the guarded" in stderr
    assert (
        "rank 1: not guarding: rank 0 found a loop it cannot guard (its own line says why), "
        "and every rank stops guarding at the same step; the script runs unguarded"
    ) in stderr
    # the probe first steps after step 2; step 3's row says so; both stand aside after it
    assert _aside_steps(tmp_path / "run", 2) == [[4], [4]]


@pytest.mark.timeout(200)
def test_a_rank_that_cannot_be_guarded_at_attach_makes_every_rank_stand_aside(
    tmp_path: Path,
) -> None:
    """Rank 1's optimizer holds a parameter of no module: rank 1 cannot find its model. The
    ranks' verdicts are agreed at the first step, so both stand aside there, rank 0's line
    naming rank 1 and its reason, and the job ends as the bare one (it hung or aborted when
    rank 1 stood aside alone while rank 0's guard began)."""
    stderr = _as_bare_two_ranks(tmp_path, "--loose-param-rank", "1", "--steps", "4")
    reason = "cannot find the model: no module called in the step (DistributedDataParallel(Net))"
    assert f"trainguard run: rank 1: not guarding: {reason}" in stderr
    assert f"trainguard run: rank 0: not guarding: rank 1: {reason}" in stderr
    assert "guarding AdamW" not in stderr  # no rank began guarding
    last = stderr.strip().splitlines()[-1]  # the reason once, as rank 1 found it
    assert last.startswith(f"trainguard run: the run was not guarded: {reason}")
    assert last.count("cannot find the model") == 1
