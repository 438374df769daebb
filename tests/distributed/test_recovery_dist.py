"""Rollback on escalation across real processes (gloo): same snapshot, same skip, same end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tg_dist import run_ranks, values
from tg_recovery import train

BATCHES = 20
POISON = {5: 1e37}  # step 5 applies a huge finite update: every later step is non-finite


def _rollback_job(rank: int, world: int, root: str, mode: str) -> dict[str, Any]:
    import trainguard as tg

    base = Path(root)

    def cfg(name: str, **extra: Any) -> dict[str, Any]:
        return {
            "config": tg.GuardConfig(
                run_dir=base / name,
                on_escalation="rollback",
                max_consecutive=3,
                snapshot_every=2,
                good_after=2,
                hang_timeout=0,
                **extra,
            )
        }

    return {
        "clean": train(rank, mode, base / "clean", BATCHES, {}, **cfg("clean")),
        "rollback": train(rank, mode, base / "rb", BATCHES, POISON, **cfg("rb")),
        "stop": train(
            rank, mode, base / "stop", 40, {i: float("nan") for i in range(6, 40)}, **cfg("stop")
        ),
    }


@pytest.mark.timeout(90)
def test_ddp_rollback_skips_the_bad_batch_and_finishes(tmp_path: Path) -> None:
    runs = values(run_ranks(_rollback_job, 2, str(tmp_path), "ddp", timeout=80))
    for rank, run in enumerate(runs):
        rb = run["rollback"]
        assert rb["error"] is None
        assert rb["finite"] and rb["same"], f"rank {rank}: params not finite/identical"
        rollbacks = [e for e in rb["events"] if e["kind"] == "rollback"]
        assert len(rollbacks) == 1
        event = rollbacks[0]
        assert event["step"] == 8 and event["restored_step"] == 4
        assert event["batches_skipped"] == [4, 5, 6, 7, 8]
        # 20 batches, 5 skipped: steps 0..8 then 4..14 again
        assert rb["step"] == BATCHES - 5
        clean = run["clean"]["eval_loss"]
        assert abs(rb["eval_loss"] - clean) <= 0.25 * clean, (rb["eval_loss"], clean)
    assert (
        runs[0]["rollback"]["events"][0]["restored_step"]
        == runs[1]["rollback"]["events"][0]["restored_step"]
    )
    for rank, run in enumerate(runs):
        stop = run["stop"]
        assert stop["error"] == "NonFiniteError", f"rank {rank} did not raise"
        rungs = [e["rung"] for e in stop["events"] if e["kind"] == "rollback"]
        assert rungs == ["rollback", "rollback+lr_backoff", "rollback+lr_backoff+reset_moments"]
        refused = [e for e in stop["events"] if e["kind"] == "rollback_refused"]
        assert refused and refused[0]["reason"] == "max_rollbacks"


def _fsdp_job(rank: int, world: int, root: str) -> dict[str, Any]:
    import trainguard as tg

    base = Path(root)

    def cfg(name: str) -> dict[str, Any]:
        config = tg.GuardConfig(
            run_dir=base / name,
            on_escalation="rollback",
            max_consecutive=3,
            snapshot_every=2,
            good_after=2,
            hang_timeout=0,
        )
        return {"config": config}

    return {
        "clean": train(rank, "fsdp", base / "clean", BATCHES, {}, **cfg("clean")),
        "rollback": train(rank, "fsdp", base / "rb", BATCHES, POISON, **cfg("rb")),
    }


@pytest.mark.timeout(90)
def test_fsdp2_rollback_restores_the_shards_on_every_rank(tmp_path: Path) -> None:
    runs = values(run_ranks(_fsdp_job, 2, str(tmp_path), timeout=80))
    for rank, run in enumerate(runs):
        rb = run["rollback"]
        assert rb["error"] is None
        assert rb["finite"] and rb["same"], f"rank {rank}: params not finite/identical"
        rollbacks = [e for e in rb["events"] if e["kind"] == "rollback"]
        assert [(e["step"], e["restored_step"]) for e in rollbacks] == [(8, 4)]
        assert rollbacks[0]["batches_skipped"] == [4, 5, 6, 7, 8]
        assert rb["step"] == BATCHES - 5
        clean = run["clean"]["eval_loss"]
        assert abs(rb["eval_loss"] - clean) <= 0.25 * clean, (rb["eval_loss"], clean)
