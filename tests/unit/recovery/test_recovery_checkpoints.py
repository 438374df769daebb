"""Known-good checkpoints on disk, in one process: atomic layout, the good-after rule through
the guard, retention of the newest K, and resume from them."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.events import read_events
from trainguard.recovery import checkpoint as ckpt
from trainguard.recovery.failure import store
from trainguard.recovery.snapshot import TrainingObjects

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "single process"


def _objects() -> TrainingObjects:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return TrainingObjects(model, opt)


def test_save_is_atomic_and_retention_keeps_the_newest_good(tmp_path: Path) -> None:
    objects = _objects()
    for step in (2, 4, 6, 8):
        saved = ckpt.save(tmp_path, step, objects, {"data": step}, None, 0)
        assert sorted(p.name for p in saved.path.iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "manifest.json",
            "rank-0.pt",
        ]
        assert json.loads((saved.path / "manifest.json").read_text())["step"] == step
    assert not list(ckpt.checkpoints_dir(tmp_path).glob(".tmp-*"))
    assert ckpt.good_checkpoints(tmp_path) == []  # none is good before healthy steps follow
    for step in (2, 4, 6):
        ckpt.mark_good(tmp_path, step, first_loss=float(step), keep=2)
    names = sorted(p.name for p in ckpt.checkpoints_dir(tmp_path).iterdir())
    assert names == ["step-00000004", "step-00000006", "step-00000008"]  # 8: still pending
    ckpt.discard(tmp_path, 8)  # a bad step came before it became good
    ckpt.discard(tmp_path, 6)  # good ones are never discarded
    assert [ckpt.step_of(p) for p in ckpt.good_checkpoints(tmp_path)] == [6, 4]
    assert ckpt.first_loss(ckpt.step_dir(tmp_path, 6)) == 6.0


def _run(run_dir: Path, batches: list[torch.Tensor], **options: object) -> tg.Guard:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    config = tg.GuardConfig.from_options({"run_dir": run_dir, "hang_timeout": 0, **options})
    guard = tg.Guard(model, opt, scheduler=sched, config=config)
    with guard, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in guard.watch(batches):
            loss = model(x).pow(2).mean()
            if x.isnan().any():
                loss = loss * float("nan")
            loss.backward()
            if guard.check(loss):
                opt.step()
                sched.step()
            opt.zero_grad(set_to_none=True)
    return guard


def test_guard_marks_good_after_healthy_steps_and_resume_continues(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(3, 4, generator=gen) for _ in range(10)]
    batches[7] = batches[7] * float("nan")  # the checkpoint of step 6 never becomes good
    _run(tmp_path, batches, checkpoint_every=2, keep_checkpoints=2, **{"recovery.good_after": 2})
    kinds = [(e["kind"], e["step"]) for e in read_events(tmp_path, 0)]
    assert ("checkpoint_good", 4) in kinds and ("checkpoint_good", 6) not in kinds
    assert [ckpt.step_of(p) for p in ckpt.good_checkpoints(tmp_path)] == [8, 4]
    resumed = _run(tmp_path, batches, checkpoint_every=2, resume=True)
    events = [e for e in read_events(tmp_path, 0) if e["kind"] == "resume"]
    assert (events[-1]["from_step"], events[-1]["position"]) == (8, 8)
    assert resumed.state.step == 10  # batches 8 and 9 only, not the whole list again


def test_a_checkpoint_of_another_world_size_is_refused_before_anything_loads(
    tmp_path: Path,
) -> None:
    """Written by 2 ranks (its manifest says so), resumed by 1: each rank's data position
    and loader state are its own. A ConfigError naming the checkpoint, both sizes and the
    fix, and the model untouched (no half-resumed fresh start)."""
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(3, 4, generator=gen) for _ in range(6)]
    _run(tmp_path, batches, checkpoint_every=2, **{"recovery.good_after": 1})
    [newest, *_] = ckpt.good_checkpoints(tmp_path)
    manifest = newest / ckpt.MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "world_size": 2}))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = tg.GuardConfig(run_dir=tmp_path, hang_timeout=0, resume=True, checkpoint_every=2)
    with pytest.raises(tg.ConfigError, match=r"resume: .*step-0+4 was written by 2 ranks and "
                       r"this job has 1: .*run with 2 ranks, or start a new run"):  # fmt: skip
        tg.Guard(model, opt, config=config)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert not model._forward_pre_hooks and not model._forward_hooks  # no hook left behind


def _rollback_run(run_dir: Path, batches: int, **options: object) -> dict[str, Any]:
    """``tg_recovery.train`` with a rollback at step 8 (a 1e37 batch at step 5, three bad
    steps in a row escalate) to the good state of step 4."""
    from tg_recovery import train

    config = tg.GuardConfig.from_options(
        {
            "run_dir": run_dir,
            "on_escalation": "rollback",
            "max_consecutive": 3,
            "hang_timeout": 0,
            "recovery.good_after": 1,
            **options,
        }
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train(0, "plain", run_dir, batches, {5: 1e37}, config=config)


def test_rollback_to_a_good_checkpoint_on_disk_without_snapshots(tmp_path: Path) -> None:
    run = _rollback_run(tmp_path, 20, checkpoint_every=2, **{"recovery.snapshot_every": 0})
    rollbacks = [e for e in run["events"] if e["kind"] == "rollback"]
    assert [(e["step"], e["restored_step"], e["source"]) for e in rollbacks] == [(8, 4, "disk")]
    assert rollbacks[0]["batches_skipped"] == [4, 5, 6, 7, 8]
    assert run["error"] is None and run["finite"] and run["step"] == 15


def test_resume_under_torchrun_with_a_shared_store_warns_on_the_first_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every rank writes the event; the log line comes from local rank 0 alone: one line
    per torchrun, not one per rank."""
    batches = [torch.ones(3, 4)] * 2
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for local_rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            _run(tmp_path / f"shared{local_rank}", batches, resume=True)
        lines = [r for r in caplog.records if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in r.message]
        assert len(lines) == (1 if said else 0)
        events = read_events(tmp_path / f"shared{local_rank}", 0)
        warned = [e for e in events if e["kind"] == "restart_config"]
        assert len(warned) == 1 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warned[0]["fix"]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what the variable gives
    _run(tmp_path / "fresh", batches, resume=True)
    assert not [e for e in read_events(tmp_path / "fresh", 0) if e["kind"] == "restart_config"]


class _Crash(Exception):
    pass


def _crashing_run(
    run_dir: Path, batches: list[torch.Tensor], crash_at: int, **options: object
) -> None:
    """``_run`` with rollback from disk, ending in an exception when ``crash_at`` batches were
    fetched (a process that dies before its next checkpoint is good)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = tg.GuardConfig.from_options({"run_dir": run_dir, "hang_timeout": 0, **options})
    with warnings.catch_warnings(), tg.Guard(model, opt, config=config) as guard:
        warnings.simplefilter("ignore")
        for fetched, x in enumerate(guard.watch(batches), start=1):
            if fetched == crash_at:
                raise _Crash
            loss = model(x).pow(2).mean()
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad(set_to_none=True)


@pytest.fixture
def forgets_its_states(tmp_path: Path) -> Iterator[None]:
    """Runs that die by an exception keep their state at the failure in /dev/shm, for a resume
    (by design): the test's own, under ``tmp_path`` and its folders, go when it ends."""
    yield
    for run_dir in (tmp_path, *(p for p in tmp_path.iterdir() if p.is_dir())):
        store.forget(run_dir, None)


def test_resume_compares_the_first_loss_only_when_the_batch_is_the_checkpoints(
    tmp_path: Path, forgets_its_states: None
) -> None:
    """The checkpoint of step 4 is good with the loss of its tiny batch 4; a NaN at step 5
    rolls back to it, skipping batches 4 and 5, and the run dies. The resume loads step 4,
    and the ledger feeds it batch 6, ten thousand times the loss: not a mismatch (another
    batch). Batch 4 changed on disk between the runs, and not skipped, is one."""
    gen = torch.Generator().manual_seed(1)
    batches = [10 * torch.randn(3, 4, generator=gen) for _ in range(12)]
    batches[4] = batches[4] / 1000  # the checkpoint's first loss: tiny
    batches[5] = batches[5] * float("nan")
    options: dict[str, object] = {
        "checkpoint_every": 4,
        "recovery.good_after": 1,
        "recovery.snapshot_every": 0,
        "on_escalation": "rollback",
        "max_consecutive": 1,
    }
    skipped_run = tmp_path / "skipped"
    with pytest.raises(_Crash):
        _crashing_run(skipped_run, batches, crash_at=9, **options)
    kinds = [(e["kind"], e["step"]) for e in read_events(skipped_run, 0)]
    assert ("checkpoint_good", 4) in kinds and ("rollback", 5) in kinds
    with pytest.raises(_Crash):
        _crashing_run(skipped_run, batches, crash_at=3, resume=True, **options)
    after_resume = [e for e in read_events(skipped_run, 0) if e.get("after") == "resume"]
    assert after_resume == [], after_resume
    assert [e["from_step"] for e in read_events(skipped_run, 0) if e["kind"] == "resume"] == [4]

    changed_run = tmp_path / "changed"
    clean = [b.nan_to_num() for b in batches]
    with pytest.raises(_Crash):
        _crashing_run(changed_run, clean, crash_at=7, **options)
    clean[4] = clean[4] * 1000  # the data changed under the checkpoint's position
    with pytest.raises(_Crash):
        _crashing_run(changed_run, clean, crash_at=3, resume=True, **options)
    [mismatch] = [e for e in read_events(changed_run, 0) if e.get("after") == "resume"]
    assert (mismatch["step"], mismatch["after"]) == (4, "resume")


@pytest.mark.parametrize(
    ("batches", "skipped", "steps"), [(20, [4, *range(5, 12)], 12), (10, [4, 5, 6, 7, 8, 9], 4)]
)
def test_skip_margin_skips_further_batches_of_the_same_pass(
    tmp_path: Path, batches: int, skipped: list[int], steps: int
) -> None:
    """A rollback at step 8 to the snapshot of step 4 skips batches 4-8 and, with
    ``skip_margin=3``, batches 9-11; at the end of the pass the margin stops (batch 9 is the
    last of 10)."""
    run = _rollback_run(
        tmp_path, batches, **{"recovery.snapshot_every": 2, "recovery.skip_margin": 3}
    )
    [rollback] = [e for e in run["events"] if e["kind"] == "rollback"]
    assert (rollback["step"], rollback["restored_step"]) == (8, 4)
    assert rollback["batches_skipped"] == skipped
    assert run["error"] is None and run["finite"] and run["step"] == steps


def test_a_rollback_after_a_resume_records_only_batches_the_ledger_did_not_drop(
    tmp_path: Path, forgets_its_states: None
) -> None:
    """A rollback to checkpoint 4 skips batches 4-8, and the process dies. The resume drops
    them (the ledger) and trains 9 and 10; 11 and 12 fail, and the rollback to the same
    checkpoint records 9-12, not 4-8 again."""
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(3, 4, generator=gen) for _ in range(16)]
    for bad in (7, 8, 11, 12):
        batches[bad] = batches[bad] * float("nan")
    options: dict[str, object] = {
        "checkpoint_every": 4,
        "recovery.good_after": 1,
        "recovery.snapshot_every": 0,
        "on_escalation": "rollback",
        "max_consecutive": 2,
        "capture": False,
    }
    with pytest.raises(_Crash):
        _crashing_run(tmp_path, batches, crash_at=10, **options)
    with pytest.raises(_Crash):
        _crashing_run(tmp_path, batches, crash_at=6, resume=True, **options)
    rollbacks = [e["batches_skipped"] for e in read_events(tmp_path, 0) if e["kind"] == "rollback"]
    assert rollbacks == [[4, 5, 6, 7, 8], [9, 10, 11, 12]]
    ledger = tmp_path / "recovery" / "skipped-rank0.jsonl"
    positions = [json.loads(line)["batch"] for line in ledger.read_text().splitlines()]
    assert positions == list(range(4, 13))
