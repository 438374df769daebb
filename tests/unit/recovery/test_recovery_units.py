"""Recovery's parts in one process: LR backoff under a torch scheduler, ladder, ledger,
the good-after rule of snapshots."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from tg_recovery import rollback_config, train

import trainguard as tg
from trainguard.recovery.backoff import Backoff, LrFactor
from trainguard.recovery.ladder import Rung, rung_for
from trainguard.recovery.ledger import SkipEntry, SkipLedger, sample_indices
from trainguard.recovery.snapshot import Snapshot, SnapshotKeeper


def _lr_seen_by_step(opt: torch.optim.Optimizer) -> list[float]:
    seen: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))
    return seen


def test_lr_factor_survives_scheduler_step_and_ramps_back() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # chainable form
    factor = LrFactor(opt)  # hooks installed first: the recorder below sees the scaled LR
    seen = _lr_seen_by_step(opt)
    factor.backoff = Backoff(start=2, factor=0.1, ramp_steps=4, zero_steps=1)
    for step in range(9):
        factor.step = step
        param.grad = torch.ones(3)
        opt.step()
        sched.step()
    schedule = [0.5**s for s in range(9)]
    factors = [1, 1, 0, 0.1, 0.325, 0.55, 0.775, 1, 1]
    assert seen == pytest.approx([s * f for s, f in zip(schedule, factors, strict=True)])
    # the scheduler's own value was never scaled: the schedule is as without a backoff
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5**9)
    assert "lr" in opt.state_dict()["param_groups"][0]


def test_backoff_state_round_trips() -> None:
    backoff = Backoff(start=3, factor=0.25, ramp_steps=10, zero_steps=2)
    again = Backoff.from_state(backoff.state_dict())
    assert [again.at(s) for s in range(20)] == [backoff.at(s) for s in range(20)]
    assert Backoff().at(5) == 1.0


def test_ladder_rungs_then_stop() -> None:
    assert [rung_for(n, 3) for n in (1, 2, 3, 4)] == [
        Rung.ROLLBACK,
        Rung.BACKOFF,
        Rung.RESET_MOMENTS,
        Rung.STOP,
    ]
    assert rung_for(2, 1) is Rung.STOP
    assert rung_for(5, 6) is Rung.RESET_MOMENTS


def test_skip_ledger_persists_and_survives_a_torn_line(tmp_path: Path) -> None:
    ledger = SkipLedger(tmp_path, rank=1)
    ledger.append([SkipEntry(0, 4, 8, "rollback", [10, 11]), SkipEntry(1, 2, 30, "rollback")])
    with open(ledger.path, "a") as fh:
        fh.write('{"epoch": 1, "bat')  # a crash mid-write
    again = SkipLedger(tmp_path, rank=1)
    assert again.entries()[0].samples == [10, 11]
    assert again.positions(0, "r1") == {4} and again.positions(1, None) == {2}
    assert SkipLedger(tmp_path, rank=0).entries() == []


def test_skip_ledger_positions_are_the_run_s_own(tmp_path: Path) -> None:
    """An entry names its run; one written before runs had ids counts for any run."""
    ledger = SkipLedger(tmp_path, rank=0)
    ledger.append([SkipEntry(0, 4, 8, "rollback", None, "a"), SkipEntry(0, 5, 8, "rollback")])
    ledger.append([SkipEntry(0, 6, 9, "rollback", None, "b")])
    assert ledger.positions(0, "a") == {4, 5}
    assert ledger.positions(0, "b") == {5, 6}


def test_sample_indices_from_a_dataloader() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    loader = torch.utils.data.DataLoader(data, batch_size=3, shuffle=False)
    assert sample_indices(loader, [1, 3]) == {1: [3, 4, 5], 3: [9]}
    assert sample_indices([1, 2, 3], [0]) == {}


def _snap(step: int) -> Snapshot:
    return Snapshot(step=step, position=step, stream_id=1, state={}, guard={}, rng={})


def test_snapshot_good_only_after_healthy_steps() -> None:
    keeper = SnapshotKeeper(every=2, good_after=2, keep=1)
    assert keeper.due(0) and not keeper.due(1) and keeper.due(4)
    keeper.add(_snap(0))
    keeper.healthy_step(0, 1.5)
    assert keeper.target(10) is None  # one healthy step: not yet good
    keeper.healthy_step(1, 1.4)
    good = keeper.target(10)
    assert good is not None and good.step == 0 and good.first_loss == 1.5
    keeper.add(_snap(2))
    keeper.healthy_step(2, 1.3)
    keeper.bad_step()  # drifting before it became good: never a target
    target = keeper.target(10)
    assert target is not None and target.step == 0
    keeper.add(_snap(4))
    keeper.healthy_step(4, 1.0)
    keeper.healthy_step(5, 1.0)
    target = keeper.target(10)
    assert target is not None and target.step == 4  # keep=1: the newest good one
    assert keeper.target(3) is None  # taken after the first bad step: not a target


@pytest.mark.parametrize("given", [True, False])
def test_a_scheduler_the_guard_was_not_given_is_named(
    tmp_path: Path, given: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A torch LR scheduler steps the optimizer but is not ``scheduler=``: the guard says at
    construction and at the rollback that its schedule is not restored (the rollback event
    records it); given, it is restored and nothing is said."""
    with caplog.at_level("WARNING", logger="trainguard"):
        out = train(
            0,
            "plain",
            tmp_path,
            16,
            {5: 1e37},
            give_scheduler=given,
            config=rollback_config(tmp_path),
        )
    rollbacks = [e for e in out["events"] if e["kind"] == "rollback"]
    assert rollbacks and all(e["scheduler_restored"] is given for e in rollbacks)
    named = [r.getMessage() for r in caplog.records if "LR scheduler" in r.getMessage()]
    assert len(named) == (0 if given else 1 + len(rollbacks))
    assert given or "ahead" in named[-1]


@pytest.mark.parametrize(
    "options", [{"on_escalation": "rollback"}, {"checkpoint_every": 2}, {"resume": True}]
)
def test_recovery_in_a_loop_without_watch_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, options: dict[str, object]
) -> None:
    """Snapshots, checkpoints and states at a failure are taken at ``watch()``'s step
    boundary: a loop that hands its batches over some other way gets none, and is told so
    at its first step, in one line, rather than at its first failure. A ``watch()`` loop is
    told nothing."""

    def run(folder: Path, watched: bool) -> list[str]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = tg.Guard(model, opt, run_dir=folder, hang_timeout=0, **options)  # type: ignore[arg-type]
        batches = [torch.ones(2, 4)] * 4
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainguard"), guard:
            for x in guard.watch(batches) if watched else batches:
                loss = model(x).sum()
                loss.backward()
                if guard.check(loss):
                    opt.step()
                opt.zero_grad()
        return [r.getMessage() for r in caplog.records if "guard.watch()" in r.getMessage()]

    lines = run(tmp_path / "plain", watched=False)
    assert len(lines) == 1 and "step 0 was not fed by guard.watch()" in lines[0]
    assert run(tmp_path / "watched", watched=True) == []
