"""States at a failure: the step-start record, the boundary proof, the folder, the choice."""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.capture.rng import RngSnapshot
from trainguard.events import read_events
from trainguard.recovery.failure import store
from trainguard.recovery.failure.boundary import Boundary, StepBoundary
from trainguard.recovery.failure.fresh import candidates, sharded_candidates
from trainguard.recovery.failure.mirror import StepMirror, mirror_path, read_mirror


def _boundary(step: int, at: str = "forward") -> Boundary:
    return Boundary(step, 0, step * 2, None, RngSnapshot.take(), at)


# -- the step-start record -------------------------------------------------------------------


def test_the_record_gives_back_the_rng_states_of_the_step_start(tmp_path: Path) -> None:
    mirror = StepMirror(tmp_path, 3)
    torch.manual_seed(7)
    mirror.write(_boundary(4))
    expected = torch.rand(5)
    torch.rand(100)
    mirror.write(_boundary(5))
    records = read_mirror(mirror_path(tmp_path, 3))
    assert [(r.step, r.position, r.pid) for r in records] == [
        (5, 10, os.getpid()),
        (4, 8, os.getpid()),
    ]
    tg_state = records[1].rng_state()
    from trainguard.capture.rng import set_rng_state

    set_rng_state(tg_state)
    assert torch.equal(torch.rand(5), expected)
    mirror.close()


def test_a_write_cut_short_leaves_the_step_before(tmp_path: Path) -> None:
    mirror = StepMirror(tmp_path, 0)
    mirror.write(_boundary(1))
    mirror.write(_boundary(2))
    path = mirror_path(tmp_path, 0)
    data = bytearray(path.read_bytes())
    # the slots take turns: step 2 (sequence number 2) is in the first; tear its trailer
    from trainguard.recovery.failure.mirror import _HEAD

    length = int.from_bytes(data[8:16], "little")
    data[_HEAD.size + length] ^= 0xFF
    path.write_bytes(bytes(data))
    assert [r.step for r in read_mirror(path)] == [1]
    mirror.close()


def test_a_restart_reads_the_records_before_it_writes_its_own(tmp_path: Path) -> None:
    first = StepMirror(tmp_path, 1)
    first.write(_boundary(9))
    first.close()
    StepMirror(tmp_path, 1)  # a restarted rank: opens at its first write only
    assert [r.step for r in read_mirror(mirror_path(tmp_path, 1))] == [9]


# -- the boundary ----------------------------------------------------------------------------


def test_a_boundary_closes_when_the_decision_or_the_update_begins() -> None:
    boundary = StepBoundary()
    assert boundary.open_now()[0] is None  # no step started
    boundary.begin(_boundary(3))
    held, _ = boundary.open_now()
    assert held is not None and held.step == 3
    boundary.deciding(3)
    assert boundary.open_now()[0] is None
    assert "step 3" in boundary.why_closed()
    boundary.begin(_boundary(4))
    boundary.update_begins()  # an update without a decision
    assert boundary.open_now()[0] is None


def test_a_hand_out_opens_the_step_only_after_the_update_before_ended() -> None:
    boundary = StepBoundary()
    boundary.begin(_boundary(0))
    boundary.deciding(0)
    boundary.decided(0, ok=True)
    assert not boundary.handout(_boundary(1, "handout"))  # fetched before the update
    boundary.update_begins()
    assert not boundary.handout(_boundary(1, "handout"))  # during it
    boundary.update_ends()
    assert boundary.handout(_boundary(1, "handout"))
    boundary.deciding(1)
    boundary.decided(1, ok=False)  # skipped: no update follows
    assert boundary.handout(_boundary(2, "handout"))
    boundary.begin(_boundary(2))
    assert not boundary.handout(_boundary(2, "handout"))  # the step started already


def test_a_copy_the_step_moved_on_during_is_dropped() -> None:
    boundary = StepBoundary()
    boundary.begin(_boundary(5))
    held, generation = boundary.open_now()
    assert held is not None and boundary.unchanged(generation)
    boundary.deciding(5)  # the main thread went on while a writer copied
    assert not boundary.unchanged(generation)
    with boundary.changing():  # a rollback's restore
        assert boundary.open_now()[0] is None


# -- the folder ------------------------------------------------------------------------------


def test_the_folder_is_the_users_alone(tmp_path: Path) -> None:
    folder = store.open_folder(tmp_path / "root" / "job")
    assert folder is not None
    assert (folder.stat().st_mode & 0o777) == 0o700
    assert (folder.parent.stat().st_mode & 0o777) == 0o700
    open_to_others = tmp_path / "shared" / "job"
    open_to_others.parent.mkdir(mode=0o755)
    open_to_others.parent.chmod(0o755)
    assert store.open_folder(open_to_others) is None


def test_one_folder_per_run_the_same_for_every_attempt(tmp_path: Path) -> None:
    a = store.job_folder(tmp_path / "run", None)
    assert a == store.job_folder(tmp_path / "run", None)
    assert a != store.job_folder(tmp_path / "other", None)
    assert store.job_folder(tmp_path / "run", str(tmp_path / "mine")).parent == tmp_path / "mine"


def test_a_state_that_would_not_fit_is_refused(tmp_path: Path) -> None:
    assert store.fits(tmp_path, 1 << 20)
    assert not store.fits(tmp_path, 1 << 60)


def test_stale_folders_of_dead_jobs_are_swept(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ours = store.open_folder(root / "ours")
    dead = store.open_folder(root / "dead")
    live = store.open_folder(root / "live")
    assert ours and dead and live
    mirror = StepMirror(live, 0)
    mirror.write(_boundary(1))  # this process writes it: alive
    (dead / "mirror-rank-0.bin").write_bytes(b"")
    old = time.time() - 2 * store.STALE_SECONDS
    for folder in (dead, live):
        for path in (folder, *folder.iterdir()):
            os.utime(path, (old, old))
    assert store.sweep_stale(ours) == [dead]
    assert live.exists() and not dead.exists()
    mirror.close()


def test_a_state_without_its_description_or_with_a_flipped_byte_is_not_read(
    tmp_path: Path,
) -> None:
    path = store.state_path(tmp_path, 7, 0)
    torch.save({"x": torch.arange(100)}, path)
    assert store.states(tmp_path) == []  # no JSON yet: incomplete
    meta = {"bytes": path.stat().st_size, "sha256": store.sha256_of(path), "world_size": 1}
    store.write_meta(path, meta)
    (found,) = store.states(tmp_path)
    assert found.step == 7 and found.intact()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert not found.intact()


# -- the choice ------------------------------------------------------------------------------


def _offer(
    rank: int, files: list[tuple[int, int, str]], records: dict[int, bool]
) -> dict[str, object]:
    return {"rank": rank, "files": [(s, w, d, 2, w) for s, w, d in files], "records": records}


def test_the_newest_step_every_rank_can_be_given_is_chosen() -> None:
    offers = [
        _offer(0, [(37, 0, "a"), (20, 0, "b")], {37: False}),
        _offer(1, [(37, 0, "a"), (20, 0, "b")], {36: False, 20: False}),
    ]
    found, refused = candidates(offers, 2, replicated=True, newer_than=-1)
    assert [(c.step, c.source, c.own, c.from_records) for c in found] == [(20, 0, [0], [1])]
    assert refused == [(37, "rank(s) [1] have neither a state nor a record of it")]


def test_states_that_hold_different_weights_are_refused() -> None:
    offers = [
        _offer(0, [(9, 0, "a"), (9, 1, "b"), (5, 0, "c"), (5, 1, "c")], {}),
        _offer(1, [(9, 0, "a"), (9, 1, "b"), (5, 0, "c"), (5, 1, "c")], {}),
    ]
    found, refused = candidates(offers, 2, replicated=True, newer_than=-1)
    assert [c.step for c in found] == [5]
    assert refused[0][0] == 9 and "different weights" in refused[0][1]


def test_a_state_older_than_a_good_checkpoint_is_not_taken() -> None:
    offers = [_offer(0, [(9, 0, "a")], {}), _offer(1, [(9, 0, "a")], {9: False})]
    assert candidates(offers, 2, replicated=True, newer_than=10)[0] == []


def test_sharded_state_needs_every_ranks_shard_from_someone() -> None:
    """FSDP2: rank 1 was lost; its snapshot shard at step 20 is on rank 0 (a peer copy); the
    step in flight (37) has rank 0's shard only."""
    files = [(37, 0, None, 2, 0), (20, 0, None, 2, 0), (20, 1, None, 2, 0)]
    offers = [{"rank": 0, "files": files, "records": {}}, {"rank": 1, "files": [], "records": {}}]
    found, refused = sharded_candidates(offers, 2, newer_than=-1)
    assert found == [(20, [0, 0])]  # rank 0 reads both shards, sends rank 1 its own
    assert refused == [(37, "the shards of rank(s) [1] are not there")]
    assert sharded_candidates(offers, 2, newer_than=20)[0] == []


def test_a_record_with_a_loader_state_of_its_own_cannot_serve() -> None:
    offers = [_offer(0, [(9, 0, "a")], {}), _offer(1, [(9, 0, "a")], {9: True})]
    assert candidates(offers, 2, replicated=True, newer_than=-1)[0] == []


# -- end to end, one process ------------------------------------------------------------------


def _train(
    run_dir: Path, steps: int, fail_at: int | None = None, shift: int = 0, **options: Any
) -> tuple[nn.Module, tg.Guard]:
    """``shift``: the data starts at that batch (an iterable that resumes by itself).
    ``options``: more ``Guard`` options."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(4, 4, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(steps)
    ]
    data = data[shift:] + data[:shift]
    guard = tg.Guard(model, opt, run_dir=run_dir, resume=True, hang_timeout=0, **options)
    try:
        with guard:
            for x, y in guard.watch(data):
                loss = nn.functional.mse_loss(model(x), y)
                if guard.state.step == fail_at:
                    raise RuntimeError("a peer is gone")  # as a collective would, mid-step
                loss.backward()
                if guard.check(loss):
                    opt.step()
                opt.zero_grad()
    except RuntimeError:
        pass
    return model, guard


def test_an_exception_mid_step_leaves_the_state_a_restart_resumes_from(tmp_path: Path) -> None:
    plain, _ = _train(tmp_path / "plain", 8)
    _train(tmp_path / "run", 8, fail_at=5)
    saved = [e for e in read_events(tmp_path / "run") if e["kind"] == "failure_state"]
    assert [(e["step"], e["saved"], e["trigger"]) for e in saved] == [
        (5, True, "exception: RuntimeError")
    ]
    resumed, _ = _train(tmp_path / "run", 8)
    resumes = [e for e in read_events(tmp_path / "run") if e["kind"] == "resume"]
    assert resumes[-1]["from_step"] == 5 and resumes[-1]["source"] == "failure_state"
    assert not [e for e in read_events(tmp_path / "run") if e["kind"] == "resume_data_mismatch"]
    for a, b in zip(plain.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    folder = store.job_folder(tmp_path / "run", None)
    assert not folder.exists()  # taken, then the run ended for good
    from trainguard.report.summary import summarize
    from trainguard.report.text import report_text

    text = report_text(summarize(tmp_path / "run"))
    assert "at failure  step 5: saved by ranks [0]" in text
    assert "step 5: resume from the state at the failure saved by ranks [0]" in text


def test_no_state_is_written_without_resume(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    guard = tg.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path, hang_timeout=0
    )
    assert guard.recovery is None or guard.recovery.failure is None
    guard.close()


@pytest.mark.parametrize("bad", [{"failure_save_seconds": 0}, {"save_at_failure": "yes"}])
def test_the_options_are_checked(bad: dict[str, object]) -> None:
    with pytest.raises(tg.ConfigError):
        tg.RecoveryConfig(**bad)


def test_a_new_run_forgets_the_states_an_earlier_run_left(tmp_path: Path) -> None:
    """Run A failed and left a state; run B starts anew (resume=False) in the same folder: a
    later resume must not take run A's state, which B's start removed."""
    _train(tmp_path / "run", 8, fail_at=5)
    folder = store.job_folder(tmp_path / "run", None)
    assert store.states(folder)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tg.Guard(model, opt, run_dir=tmp_path / "run", hang_timeout=0).close()
    assert not folder.exists()


def test_a_state_is_hashed_as_it_is_written() -> None:
    """The checksum in the state's description is the file's own (``torch.save`` writes its
    archive front to back), so the writer never reads the file back."""
    import hashlib
    import io

    from trainguard.recovery.failure.writer import _HashingFile

    payload = {"w": torch.randn(300, 301), "parts": [torch.randn(7) for _ in range(40)], "n": 3}
    raw = io.BytesIO()
    hashing = _HashingFile(raw)
    torch.save(payload, hashing)
    assert hashing.hexdigest() == hashlib.sha256(raw.getvalue()).hexdigest()
    assert torch.equal(torch.load(io.BytesIO(raw.getvalue()))["w"], payload["w"])


@pytest.mark.parametrize("fault", ["folder_removed", "memory_full"])
def test_a_step_start_record_that_cannot_be_written_is_given_up_not_raised(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fault: str,
) -> None:
    """The record is written inside the model's forward hook: its folder removed before the
    first step (another rank's run ended and removed it while empty) or the memory file
    system full must not raise there. One warning; the run trains as without the guard."""
    plain, _ = _train(tmp_path / "plain", 6)
    folder = store.job_folder(tmp_path / "run", None)
    if fault == "folder_removed":
        real_open = store.open_folder

        def open_then_removed(path: Path) -> Path | None:
            opened = real_open(path)
            if opened is not None:
                os.rmdir(opened)
            return opened

        monkeypatch.setattr(store, "open_folder", open_then_removed)
    else:

        def full(fd: int, offset: int, size: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "posix_fallocate", full)
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        model, guard = _train(tmp_path / "run", 6)
    lines = [r.message for r in caplog.records if "step-start record" in r.message]
    assert len(lines) == 1 and str(folder) in lines[0]
    assert guard.state.step == 6
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("source", ["failure_state", "checkpoint"])
def test_a_resume_fed_batches_in_another_order_is_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, source: str
) -> None:
    """A state at a failure and a checkpoint hold a digest of their step's first batch; a
    resume whose iterable starts where the loop left off by itself (``watch()`` skips to
    the position on top of it) is handed another batch there: one line and a
    ``resume_data_mismatch`` event, not a run that silently trains on other data. The
    same iterable from its beginning: no event."""
    options: dict[str, Any] = {}
    if source == "checkpoint":
        options = {"checkpoint_every": 2, "recovery.save_at_failure": False}
    step = 5 if source == "failure_state" else 2  # the checkpoint of step 4 is not good yet
    for run, shift in (("same", 0), ("shifted", 5)):
        _train(tmp_path / run, 8, fail_at=5, **options)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            _train(tmp_path / run, 8, shift=shift, **options)
        (resume,) = [e for e in read_events(tmp_path / run) if e["kind"] == "resume"][-1:]
        assert resume["from_step"] == step
        assert resume.get("source", "checkpoint") == source  # a checkpoint's names its path
        events = read_events(tmp_path / run)
        mismatches = [e for e in events if e["kind"] == "resume_data_mismatch"]
        lines = [r.getMessage() for r in caplog.records if "resumed step" in r.getMessage()]
        if not shift:
            assert mismatches == [] and lines == []
            continue
        (mismatch,) = mismatches
        assert (mismatch["step"], mismatch["position"], mismatch["epoch"]) == (step, step, 0)
        assert len(lines) == 1 and f"resumed step {step} " in lines[0]
        assert "from its beginning" in lines[0]
