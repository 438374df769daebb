"""Snapshots and checkpoints taken more often than ``good_after`` lets them become good, and a
checkpoint step that comes round again after a rollback: in one process."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.recovery import checkpoint as ckpt
from trainguard.testing import poison_loss

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "single process"


def _train(run_dir: Path, bad: set[int], calls: int = 24, **options: Any) -> tg.Guard:
    """``calls`` checks of a tiny model; the checks numbered in ``bad`` non-finite."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(2, 4, generator=gen), torch.randn(2, 1, generator=gen)) for _ in range(calls)
    ]
    config = tg.GuardConfig.from_options(
        {
            "run_dir": run_dir,
            "hang_timeout": 0,
            "on_escalation": "rollback",
            "max_consecutive": 2,
            **options,
        }
    )
    with tg.Guard(model, opt, config=config) as guard, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for call, (x, y) in enumerate(guard.watch(data)):
            loss = nn.functional.mse_loss(model(x), y)
            if call in bad:
                loss = poison_loss(loss)
            loss.backward()  # type: ignore[no-untyped-call]
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    return guard


def _kinds(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in tg.read_events(run_dir, 0) if e["kind"] == kind]


def test_snapshots_every_step_still_become_good_and_a_rollback_finds_one(tmp_path: Path) -> None:
    # good_after=2 (the default) and a snapshot due at every step: each replaced the last
    # before it was judged, none became good, and the rollback was refused
    _train(tmp_path, bad={9, 10}, **{"recovery.snapshot_every": 1})
    assert not _kinds(tmp_path, "rollback_refused")
    (rollback,) = _kinds(tmp_path, "rollback")
    assert rollback["step"] == 10 and rollback["restored_step"] <= 9


def test_checkpoints_every_step_become_good_and_are_kept_to_the_limit(tmp_path: Path) -> None:
    _train(tmp_path, bad=set(), calls=12, checkpoint_every=1, keep_checkpoints=2)
    good = _kinds(tmp_path, "checkpoint_good")
    assert len(good) >= 3  # before: none, and every checkpoint stayed on disk
    on_disk = list(ckpt.checkpoints_dir(tmp_path).glob("step-*"))
    assert len(on_disk) <= 2 + 1  # keep_checkpoints good ones, and the one being judged


def test_a_discarded_checkpoint_step_is_saved_again_when_the_run_comes_back_to_it(
    tmp_path: Path,
) -> None:
    # checkpoints at 3 and 6 (good_after=3); step 6's is still being judged when step 7 goes
    # bad: discarded. The escalation at 8 rolls back to step 3's (disk), and step 6 comes
    # round again: it was never written again (the step had been "saved already")
    _train(tmp_path, bad={7, 8}, checkpoint_every=3, **{"recovery.good_after": 3})
    (rollback,) = _kinds(tmp_path, "rollback")
    assert (rollback["restored_step"], rollback["source"]) == (3, "disk")
    saved = [(e["step"], e["time"] > rollback["time"]) for e in _kinds(tmp_path, "checkpoint")]
    assert (6, False) in saved and (6, True) in saved  # written, discarded, written again
    assert 6 in [e["step"] for e in _kinds(tmp_path, "checkpoint_good")]


def test_disk_checkpoints_of_a_zero_optimizer_are_refused_when_the_guard_is_built(
    tmp_path: Path,
) -> None:
    """Its state_dict() raises unless consolidated: the first checkpoint crashed the run (and
    every restart), mid-run. In-memory snapshots keep each rank's shard: allowed."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        model = nn.Linear(4, 1)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
        with pytest.raises(tg.ConfigError, match="checkpoint_every: a ZeroRedundancyOptimizer"):
            tg.Guard(model, opt, run_dir=tmp_path / "a", hang_timeout=0, checkpoint_every=2)
        recovery = tg.RecoveryConfig(on_escalation="rollback", snapshot_every=2)
        with tg.Guard(
            model, opt, run_dir=tmp_path / "b", hang_timeout=0, recovery=recovery
        ) as guard:
            assert guard.recovery is not None
    finally:
        dist.destroy_process_group()
