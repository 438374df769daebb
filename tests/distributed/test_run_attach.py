"""``trainguard run`` on an unmodified script (tests/support/run_scripts/train_ddp.py imports
nothing of trainguard): one process and 2-rank DDP under torchrun (gloo, c10d rendezvous).

The reference for a skipped step is the bare script told to leave that step out
(``--drop-step``: no forward, no update): a skip must leave every rank's weights, buffers and
optimizer state bit-identical to it. A guarded run with no fault must be bit-identical to the
bare one; both leave out the same step, so the bare run serves both comparisons.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tg_run import SCRIPT
from tg_run import assert_same as _assert_same
from tg_run import guarded as _guarded
from tg_run import launch as _launch
from tg_run import run as _run

import trainguard as tg

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_ddp.py"
DROP = 3
CLIP = 0.05


@pytest.fixture(scope="module", params=[1, 2], ids=["1-process", "2-rank-torchrun"])
def bare(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bare script's result, leaving out step DROP (no trainguard)."""
    ranks = int(request.param)
    out = tmp_path_factory.mktemp(f"bare{ranks}")
    done = _run([*_launch(ranks, bare=True), "--out", str(out), "--drop-step", str(DROP)])
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _ranks(out: Path) -> int:
    return len(list(out.glob("rank*.pt")))


@pytest.mark.timeout(200)
def test_no_fault_leaves_the_results_bit_identical(bare: Path, tmp_path: Path) -> None:
    ranks = _ranks(bare)
    cmd = [*_guarded(tmp_path / "run"), "--", *_launch(ranks)]
    done = _run([*cmd, "--out", str(tmp_path / "out"), "--drop-step", str(DROP)])
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(ranks):
        assert f"trainguard run: rank {rank}: guarding AdamW over" in done.stderr
    assert done.stderr.count("it reads the loss the script computes") == ranks
    _assert_same(tmp_path / "out", bare, ranks)
    kinds = {e["kind"] for e in tg.read_events(tmp_path / "run", ranks - 1)}
    assert "start" in kinds and "skip" not in kinds
    lines = (tmp_path / "run" / "metrics" / "rank-0.jsonl").read_text().splitlines()
    losses = [json.loads(line)["losses"] for line in lines]  # every rank's, agreed, each step
    assert losses and all(len(ls) == ranks and all(v > 0 for v in ls) for ls in losses)


@pytest.mark.timeout(200)
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(bare: Path, tmp_path: Path) -> None:
    ranks = _ranks(bare)
    nan_rank = ranks - 1
    run_dir = tmp_path / "run"
    cmd = [*_guarded(run_dir), "--", *_launch(ranks), "--out", str(tmp_path / "out")]
    done = _run([*cmd, "--nan-rank", str(nan_rank), "--nan-step", str(DROP)])
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same(tmp_path / "out", bare, ranks)  # as if the step never happened
    for rank in range(ranks):
        events = tg.read_events(run_dir, rank)
        skips = [e for e in events if e["kind"] == "skip"]
        assert [e["step"] for e in skips] == [DROP]
        assert skips[0]["buffers_restored"] > 0  # BatchNorm's statistics put back
    bundle = run_dir / "captures" / f"step-{DROP:08d}"
    assert (bundle / "manifest.json").is_file()
    # the samples by their dataset indices, as the script's DataLoader drew them (4 a step,
    # in order; the NaN is sample 0 of step 3's batch): the event and the bundle
    (bad,) = [e for e in tg.read_events(run_dir, nan_rank) if e["kind"] == "bad_input"]
    assert [(t["positions"], t["dataset_indices"]) for t in bad["tensors"]] == [([0], [DROP * 4])]
    meta = json.loads((bundle / f"rank-{nan_rank}" / "meta.json").read_text())
    assert meta["dataset_indices"] == [list(range(DROP * 4, DROP * 4 + 4))]
    assert f"(dataset indices [{DROP * 4}])" in done.stderr
    if ranks == 1:
        return
    replay = _run(
        [
            sys.executable,
            "-m",
            "trainguard.cli",
            "replay",
            str(bundle),
            "--factory",
            f"{SCRIPT}:make_replay",
            "--repeats",
            "1",
            "--json",
        ]
    )
    assert replay.returncode == 1, replay.stderr[-2000:]  # 1: the step reproduced
    report = json.loads(replay.stdout)
    assert report["reproduced"] and report["rank"] == nan_rank
    assert report["verdict"] == "bad_input"


@pytest.mark.timeout(200)
def test_a_nan_made_after_the_loss_is_named_on_its_rank(bare: Path, tmp_path: Path) -> None:
    """Rank R's loss times NaN before its backward (past the loss the guard reads): DDP's
    all-reduce spreads the NaN to every rank's gradients, and every rank's event used to
    say ``grad_ranks`` all, ``loss_ranks`` none. The tensor the backward ran on is the
    rank's loss now: every rank names rank R, and skips the step."""
    ranks = _ranks(bare)
    nan_rank, run_dir = ranks - 1, tmp_path / "run"
    cmd = [*_guarded(run_dir), "--", *_launch(ranks), "--out", str(tmp_path / "out")]
    done = _run([*cmd, "--loss-nan-rank", str(nan_rank), "--loss-nan-step", str(DROP)])
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same(tmp_path / "out", bare, ranks)
    for rank in range(ranks):
        events = tg.read_events(run_dir, rank)
        (bad,) = [e for e in events if e["kind"] == "nonfinite"]
        assert (bad["step"], bad["where"], bad["loss_ranks"]) == (DROP, "loss", [nan_rank])
        assert bad["grad_ranks"] == list(range(ranks))
        assert [e["step"] for e in events if e["kind"] == "skip"] == [DROP]


@pytest.mark.timeout(120)
def test_a_rank_blocked_in_its_loader_ends_every_rank_with_91(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    cmd = [*_guarded(run_dir, "--hang-timeout", "3"), "--", *_launch(2), "--out", str(out)]
    done = _run([*cmd, "--block-rank", "1", "--block-step", "4"], timeout=100)
    ended = time.time()
    assert done.returncode == tg.EXIT_HANG, done.stderr[-3000:]
    blocked = float((out / "blocked-rank1").read_text())
    for rank in (0, 1):  # every rank's verdict within the timeout + 10 s
        (hang,) = [e for e in tg.read_events(run_dir, rank) if e["kind"] == "hang"]
        assert hang["time"] - blocked < 3 + 10
    # and every rank has exited, the job is gone (4.0-5.2 s in 10 runs on a quiet 2-core box)
    assert ended - blocked < 3 + 10
    assert "exitcode  : 91" in done.stderr  # torchrun saw both workers exit with 91
    (report_path,) = run_dir.glob("hangs/*/report.json")
    report = json.loads(report_path.read_text())
    assert report["kind"] == "hang" and report["culprits"] == [1]
    assert {r["rank"]: r["phase"] for r in report["ranks"]}[1] == "data"


@pytest.mark.timeout(120)
def test_a_long_save_and_ema_evaluation_on_one_rank_are_not_a_hang(tmp_path: Path) -> None:
    """Rank 0 alone writes a checkpoint (``torch.save``), then evaluates an EMA copy made
    before the guard, each for longer than the hang timeout, while rank 1 waits in a
    barrier: the script marks neither, the guard tells both from a hang."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    cmd = [*_guarded(run_dir, "--hang-timeout", "2"), "--", *_launch(2), "--out", str(out)]
    save = ["--save-rank", "0", "--save-step", "3", "--save-seconds", "5", "--eval-seconds", "5"]
    done = _run([*cmd, *save], timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (run_dir / "hangs").exists()
    for rank in (0, 1):
        assert "hang" not in [e["kind"] for e in tg.read_events(run_dir, rank)]
    first, second = (torch.load(out / f"rank{rank}.pt")["model"] for rank in (0, 1))
    weights = [key for key in first if "running" not in key and "batches" not in key]
    assert all(torch.equal(first[key], second[key]) for key in weights)  # replicas agree


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("ranks", "clip"), [(1, False), (2, True)], ids=["1-process", "2-rank-torchrun-clip"]
)
def test_an_optimizer_made_anew_is_guarded_on_the_same_run(
    tmp_path: Path, ranks: int, clip: bool
) -> None:
    """The script makes its optimizer anew at step 3, and that very step's batch holds a NaN
    on the last rank: the step is skipped on every rank, on the one run, and the results are
    those of the bare script leaving that step out. Without a clip the new optimizer's guard
    checks step 3 (with the step's start the old guard recorded at its forward); with one,
    the old guard checked it at the clip, and the new one takes over from step 4, checking
    before the script's clip too."""
    extra = ["--steps", "8"] + (["--clip", str(CLIP)] if clip else [])
    bare_out, out, run_dir = tmp_path / "bare", tmp_path / "out", tmp_path / "run"
    # the bare script leaves step 3 out and makes its optimizer at step 4: the same, as the
    # skipped step leaves the new optimizer untouched
    left_out = ["--renew-step", "4", "--drop-step", "3", *extra]
    bare = _run([*_launch(ranks, bare=True), "--out", str(bare_out), *left_out])
    assert bare.returncode == 0, bare.stderr[-3000:]
    cmd = [*_guarded(run_dir), "--", *_launch(ranks), "--out", str(out), "--renew-step", "3"]
    done = _run([*cmd, *extra, "--nan-rank", str(ranks - 1), "--nan-step", "3"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not guarding" not in done.stderr
    takes_over = 4 if clip else 3
    for rank in range(ranks):
        line = f"trainguard run: rank {rank}: the script made a new optimizer (AdamW, was AdamW):"
        assert f"{line} guarding it from step {takes_over}" in done.stderr
        events = tg.read_events(run_dir, rank)
        assert [e["step"] for e in events if e["kind"] == "optimizer_replaced"] == [takes_over]
        assert [e["step"] for e in events if e["kind"] == "skip"] == [3]
        assert len({e["run"] for e in events}) == 1  # one run, two guards
    _assert_same(bare_out, out, ranks)
    bundle = tg.load_bundle(run_dir / "captures" / "step-00000003")
    ((x, y),) = bundle.batches(ranks - 1)  # recorded at the forward, before the handover
    assert not torch.isfinite(x).all() and bundle.rng(ranks - 1) is not None
    assert y.shape[0] == x.shape[0]  # F.mse_loss(model(x), y): its targets kept beside x
    if clip:  # the new guard checks before the script's clip: the norm the clip measured
        clip_norms = torch.load(out / "rank0.pt")["clip_norms"]
        lines = (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()
        norms = {line["step"]: line["grad_norm"] for line in map(json.loads, lines)}
        for step in range(4, 8):
            assert norms[step] > CLIP and abs(norms[step] - clip_norms[step]) <= 1e-5 * norms[step]
    report = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", str(run_dir), "--no-html"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0 and "skip 1" in report.stdout, report.stdout
    assert "starts" not in report.stdout  # one start: the new guard goes on with it


@pytest.mark.timeout(200)
def test_a_zero_redundancy_optimizer_is_guarded_with_the_shard_optimizer_it_steps(
    tmp_path: Path,
) -> None:
    """``ZeroRedundancyOptimizer`` (llm.c's ``train_gpt2.py --zero_stage 1``) steps its
    shard's AdamW inside its own step: that step is part of the guarded one, not a second
    optimizer (the guard stood aside at the second step). Rank 1's NaN at step 3 is skipped
    on both ranks, every other step is guarded, and each rank's weights and shard state are
    those of the bare script leaving step 3 out."""
    bare_out, out, run_dir = tmp_path / "bare", tmp_path / "out", tmp_path / "run"
    zero = ["--optimizer", "zero", "--steps", "8"]
    bare = _run([*_launch(2, bare=True), "--out", str(bare_out), *zero, "--drop-step", str(DROP)])
    assert bare.returncode == 0, bare.stderr[-3000:]
    cmd = [*_guarded(run_dir), "--", *_launch(2), "--out", str(out), *zero]
    done = _run([*cmd, "--nan-rank", "1", "--nan-step", str(DROP)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not guarding" not in done.stderr and "second optimizer" not in done.stderr
    for rank in range(2):
        assert f"rank {rank}: guarding ZeroRedundancyOptimizer over" in done.stderr
        events = tg.read_events(run_dir, rank)
        assert [e["step"] for e in events if e["kind"] == "skip"] == [DROP]
    lines = (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()  # every rank's
    assert [json.loads(line)["step"] for line in lines] == list(range(8))
    _assert_same(out, bare_out, 2)


@pytest.mark.timeout(200)
def test_a_second_optimizer_over_the_rest_of_the_model_is_part_of_the_guarded_step(
    tmp_path: Path,
) -> None:
    """One model, two optimizers (nanochat's split: AdamW over most of the model, then Muon
    over its matrices, here head.weight): Muon steps in the step AdamW's check covered. A NaN
    in Muon's matrix on rank 1 alone skips the step for both optimizers on both ranks, and
    each rank's weights and both optimizers' states are the bare script's leaving it out."""
    bare_out, out, run_dir = tmp_path / "bare", tmp_path / "out", tmp_path / "run"
    bare = _run([*_launch(2, bare=True), "--out", str(bare_out), "--muon", "--drop-step", "3"])
    assert bare.returncode == 0, bare.stderr[-3000:]
    cmd = [*_guarded(run_dir), "--", *_launch(2), "--out", str(out), "--muon"]
    done = _run([*cmd, "--grad-nan-rank", "1", "--grad-nan-step", "3"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not guarding" not in done.stderr
    for rank in range(2):
        events = tg.read_events(run_dir, rank)
        bad = [(e["step"], e["ranks"], e["params"]) for e in events if e["kind"] == "nonfinite"]
        assert bad == [(3, [1], ["head.weight"] if rank == 1 else [])]  # named where it is
        assert [e["step"] for e in events if e["kind"] == "skip"] == [3]
        muon = torch.load(out / f"rank{rank}.pt")["muon"]["state"]
        bare_muon = torch.load(bare_out / f"rank{rank}.pt")["muon"]["state"]
        assert torch.equal(muon[0]["momentum_buffer"], bare_muon[0]["momentum_buffer"])
    _assert_same(out, bare_out, 2)


@pytest.mark.timeout(100)
def test_a_second_optimizer_makes_it_stand_aside(tmp_path: Path) -> None:
    cmd = [*_guarded(tmp_path / "run"), "--", *_launch(1), "--out", str(tmp_path / "out")]
    done = _run([*cmd, "--second-optimizer", "--steps", "4"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trainguard run: rank 0: guarding AdamW over Net" in done.stderr
    assert "not guarding: a second optimizer (SGD) steps besides the guarded AdamW" in done.stderr
    assert "the script runs unguarded" in done.stderr
    (aside,) = [e for e in tg.read_events(tmp_path / "run", 0) if e["kind"] == "stand_aside"]
    assert "a second optimizer" in aside["reason"]  # and the report says so, not "ok"
    report = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", str(tmp_path / "run"), "--no-html"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "stood aside step" in report.stdout and "a second optimizer" in report.stdout


@pytest.mark.timeout(150)
def test_lightning_with_its_own_guard_stands_aside(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    cmd = [*_guarded(tmp_path / "outer"), "--", sys.executable, str(EXAMPLE)]
    done = _run([*cmd, "--run-dir", str(tmp_path / "inner")], timeout=140)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        line = f"trainguard run: rank {rank}: not guarding: DistributedDataParallel("
        assert line in done.stderr
    assert "the script's own guard keeps the run" in done.stderr
    outer = tmp_path / "outer"  # made up front; the outer guard never wrote, but why not
    assert {path.name for path in outer.iterdir()} == {"attach"}
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("trainguard run: not attached: the script's own guard kept the run")
    assert list((tmp_path / "inner" / "captures").glob("step-*"))  # the callback's guard did


@pytest.mark.timeout(150)
def test_lightning_without_a_guard_is_guarded_through_its_closure(tmp_path: Path) -> None:
    """Lightning runs forward and backward inside ``optimizer.step(closure)``: the guard
    checks when the closure returns, and sees the loss it returns."""
    pytest.importorskip("lightning")
    script = SCRIPT.parent / "train_lightning.py"
    done = _run([*_guarded(tmp_path / "run"), "--", sys.executable, str(script)], timeout=140)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trainguard run: rank 0: guarding SGD over Sequential" in done.stderr
    assert "weights finite: True" in done.stderr
    events = tg.read_events(tmp_path / "run", 0)
    (bad,) = [e for e in events if e["kind"] == "nonfinite"]
    assert bad["step"] == 2 and bad["where"] == "loss"
    assert [e["step"] for e in events if e["kind"] == "skip"] == [2]


def _kinds_at(events: list[dict[str, object]], step: int) -> list[str]:
    return [str(e["kind"]) for e in events if e.get("step") == step and e["kind"] != "phase"]


@pytest.mark.timeout(200)
def test_the_scripts_own_skip_of_a_nan_step_is_every_ranks_skip(bare: Path, tmp_path: Path) -> None:
    """The script skips ``optimizer.step()`` itself when its loss is not finite: only the rank
    whose batch holds the NaN does. The guard, waiting in the other ranks' optimizer step, is
    joined at that rank's ``zero_grad`` (attach/drops.py): the step is skipped on every rank
    and every rank ends as the bare script leaving the step out. Before: the other ranks' guard
    all-reduce met the skipping rank's next DDP all-reduce (gloo aborted the job); in one
    process, the left-out step's batch was counted into the next step, skipped too."""
    ranks = _ranks(bare)
    nan_rank, run_dir = ranks - 1, tmp_path / "run"
    cmd = [*_guarded(run_dir), "--", *_launch(ranks), "--out", str(tmp_path / "out")]
    done = _run([*cmd, "--nan-rank", str(nan_rank), "--nan-step", str(DROP), "--skip-nonfinite"])
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same(tmp_path / "out", bare, ranks)
    for rank in range(ranks):
        events = tg.read_events(run_dir, rank)
        assert [e["step"] for e in events if e["kind"] == "skip"] == [DROP]
        (bad,) = [e for e in events if e["kind"] == "bad_input"]
        assert bad["step"] == DROP and bad["ranks"] == [nan_rank]
        assert "dropped" not in {e["kind"] for e in events}  # a bad step, decided as one


@pytest.mark.timeout(200)
def test_a_step_one_rank_leaves_out_is_left_out_on_every_rank(bare: Path, tmp_path: Path) -> None:
    """The last rank's loop leaves a finite step's update out by its own rule: every rank
    leaves it out (``dropped``), so the replicas stay identical, and they end as the bare
    script leaving the step out (the other ranks' update dropped, the step's buffers put back
    on every rank). In one process the loop's own choice is left as it made it: recorded,
    not a bad step, its buffers untouched."""
    ranks = _ranks(bare)
    own, run_dir, out = ranks - 1, tmp_path / "run", tmp_path / "out"
    cmd = [*_guarded(run_dir), "--", *_launch(ranks), "--out", str(out)]
    done = _run([*cmd, "--own-skip-rank", str(own), "--own-skip-step", str(DROP)])
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(ranks):
        events = tg.read_events(run_dir, rank)
        assert _kinds_at(events, DROP) == ["dropped"]
        (dropped,) = [e for e in events if e["kind"] == "dropped"]
        assert dropped["ranks"] == [own]
    if ranks == 1:
        reference = tmp_path / "reference"  # the bare script with the same rule
        bare_cmd = [*_launch(1, bare=True), "--out", str(reference)]
        done = _run([*bare_cmd, "--own-skip-rank", "0", "--own-skip-step", str(DROP)])
        assert done.returncode == 0, done.stderr[-3000:]
        _assert_same(out, reference, 1)
        return
    assert "rank(s) [1] left the optimizer step out themselves" in done.stderr
    _assert_same(out, bare, ranks)


@pytest.mark.timeout(200)
def test_every_ranks_scaler_overflow_is_the_scalers_skip(tmp_path: Path) -> None:
    """A GradScaler leaves out a step whose scaled gradients overflowed, on every rank (DDP's
    gradients are the same): that is the scaler's skip, recorded as ``overflow``, neither a
    non-finite step nor a drop, and the run is bit-identical to the bare script."""
    ranks, run_dir = 2, tmp_path / "run"
    args = ["--scaler", "--overflow-rank", "0", "--overflow-step", str(DROP)]
    done = _run([*_launch(ranks, bare=True), "--out", str(tmp_path / "bare"), *args])
    assert done.returncode == 0, done.stderr[-3000:]
    cmd = [*_guarded(run_dir), "--", *_launch(ranks), "--out", str(tmp_path / "out"), *args]
    done = _run(cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same(tmp_path / "out", tmp_path / "bare", ranks)
    for rank in range(ranks):
        scale = torch.load(tmp_path / "out" / f"rank{rank}.pt")["scale"]
        assert scale == torch.load(tmp_path / "bare" / f"rank{rank}.pt")["scale"] == 2.0**9
        events = tg.read_events(run_dir, rank)
        assert _kinds_at(events, DROP) == ["overflow"]
        kinds = {e["kind"] for e in events}
        assert not kinds & {"nonfinite", "skip", "dropped", "bad_input"}
    lines = (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()
    decisions = {line["step"]: line["decision"] for line in map(json.loads, lines)}
    assert decisions == {step: "overflow" if step == DROP else "ok" for step in range(8)}


"""The scripts' ``--clip``: small enough that every step's gradients are clipped."""


@pytest.mark.timeout(240)
def test_a_script_that_clips_is_checked_before_its_clip(tmp_path: Path) -> None:
    """The script clips (``clip_grad_norm_``) before ``optimizer.step()``: the guard checks
    before the clip, so a NaN put in one gradient is named there (the clip would spread it to
    every gradient) and the recorded gradient norm is the one the clip measured, not the
    clipped one; the skip leaves every rank as the bare script leaving the step out. 2 ranks
    only (the wrappers are the same in one process: tests/unit/attach/test_attach_clip.py)."""
    ranks = 2
    bare, out, run_dir = tmp_path / "bare", tmp_path / "out", tmp_path / "run"
    clip = ["--clip", str(CLIP)]
    done = _run([*_launch(ranks, bare=True), "--out", str(bare), *clip, "--drop-step", str(DROP)])
    assert done.returncode == 0, done.stderr[-3000:]
    nan_rank = ranks - 1
    cmd = [*_guarded(run_dir), "--", *_launch(ranks), "--out", str(out), *clip]
    done = _run([*cmd, "--grad-nan-rank", str(nan_rank), "--grad-nan-step", str(DROP)])
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same(out, bare, ranks)
    for rank in range(ranks):
        events = tg.read_events(run_dir, rank)
        assert [e["step"] for e in events if e["kind"] == "skip"] == [DROP]
        (bad,) = [e for e in events if e["kind"] == "nonfinite"]
        assert bad["step"] == DROP and bad["grad_ranks"] == [nan_rank]
        if rank == nan_rank:  # the one gradient the NaN was put in, not all of them
            assert len(bad["params"]) == 1 and bad["params"][0].endswith("head.weight")
    clip_norms = torch.load(out / "rank0.pt")["clip_norms"]
    lines = (run_dir / "metrics" / "rank-0.jsonl").read_text().splitlines()  # agreed values
    norms = {line["step"]: line["grad_norm"] for line in map(json.loads, lines)}
    assert set(norms) == set(range(8))
    # the first step is checked at the optimizer step (the guard attaches there), after the
    # clip; from the second on, before it: the norm the clip measured
    assert norms[0] <= CLIP * (1 + 1e-5)
    # the bad step's norm is not finite, though rank 0's gradients were (the NaN was put in
    # after DDP's all-reduce)
    assert not math.isfinite(float(norms[DROP]))  # written "inf"
    for step in set(range(1, 8)) - {DROP}:
        assert norms[step] > 10 * CLIP
        assert abs(norms[step] - clip_norms[step]) <= 1e-5 * clip_norms[step], step


@pytest.mark.timeout(200)
def test_a_lightning_ddp_job_with_its_defaults_is_guarded_from_step_0(tmp_path: Path) -> None:
    """Lightning's defaults, 2-rank DDP (its own launcher): the sanity-check validation left
    the DDP wrapper in eval mode while the LightningModule trained, so no training forward
    was seen ("cannot find the model": the job ran unguarded), and once attached, every
    step after a validation recorded no batch (a bundle with nothing to replay). Now every
    rank guards from step 0, a NaN in epoch 1 (after two validations) is skipped on both
    ranks, and its bundle holds every rank's batch."""
    pytest.importorskip("lightning")
    script = SCRIPT.parent / "train_lightning_ddp.py"
    run_dir = tmp_path / "run"
    done = _run([*_guarded(run_dir), "--", sys.executable, str(script)], timeout=190)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"trainguard run: rank {rank}: guarding SGD over DistributedDataParallel" in (
            done.stderr
        )
        assert f"rank {rank}: trained 6 steps; weights finite: True" in done.stderr
    skips = []
    for rank in (0, 1):
        events = tg.read_events(run_dir, rank)
        assert [e["step"] for e in events if e["kind"] == "start"] == [0]
        skips.append([e["step"] for e in events if e["kind"] == "skip"])
    assert skips[0] == skips[1] and len(skips[0]) == 1 and skips[0][0] >= 3  # epoch 1
    bundle = tg.load_bundle(run_dir / "captures" / f"step-{skips[0][0]:08d}")
    for rank in (0, 1):
        assert bundle.batches(rank), rank  # the step's micro-batch, on every rank
