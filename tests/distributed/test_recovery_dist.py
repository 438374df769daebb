"""Rollback on escalation across real processes (gloo): same snapshot, same skip, same end."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import run_ranks, values
from tg_recovery import rollback_config, train

from trainguard.events import read_events

BATCHES = 20
POISON = {5: 1e37}  # step 5 applies a huge finite update: every later step is non-finite


def _rollback_job(rank: int, world: int, root: str, mode: str) -> dict[str, Any]:

    base = Path(root)

    def cfg(name: str, **extra: Any) -> dict[str, Any]:
        return {"config": rollback_config(base / name, **extra)}

    return {
        "clean": train(rank, mode, base / "clean", BATCHES, {}, **cfg("clean")),
        "rollback": train(rank, mode, base / "rb", BATCHES, POISON, ema=True, **cfg("rb")),
        "stop": train(
            rank, mode, base / "stop", 40, {i: float("nan") for i in range(6, 40)}, **cfg("stop")
        ),
    }


def _prefetch_job(rank: int, world: int, root: str) -> dict[str, Any]:
    import trainguard as tg

    config: dict[str, Any] = {
        "on_escalation": "rollback",
        "max_consecutive": 3,
        "recovery.snapshot_every": 2,
        "recovery.good_after": 2,
        "hang_timeout": 0,
    }
    runs = {}
    for name, prefetch in (("plain", False), ("prefetch", True)):
        run_dir = Path(root) / name
        cfg = tg.GuardConfig.from_options({"run_dir": run_dir, **config})
        runs[name] = train(rank, "ddp", run_dir, BATCHES, POISON, config=cfg, prefetch=prefetch)
    return runs


@pytest.mark.timeout(90)
def test_ddp_rollback_in_a_prefetching_loop_matches_the_plain_loop(tmp_path: Path) -> None:
    """nanoGPT's loop takes the next batch before backward: the same snapshot (the step's
    own first batch), the same skip, and the held batch trains the restored step, so both
    ranks end with the plain loop's weights, bit for bit."""
    runs = values(run_ranks(_prefetch_job, 2, str(tmp_path), timeout=80))
    for rank, run in enumerate(runs):
        plain, fetched = run["plain"], run["prefetch"]
        assert fetched["error"] is None and fetched["finite"] and fetched["same"], rank
        [event] = [e for e in fetched["events"] if e["kind"] == "rollback"]
        assert (event["step"], event["restored_step"]) == (8, 4)
        assert event["batches_skipped"] == [4, 5, 6, 7, 8]  # not 9: the loop holds it
        assert fetched["step"] == plain["step"] == BATCHES - 5
        assert torch.equal(fetched["params"], plain["params"]), rank


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
        # the loop's EMA (extra_state) came back with the weights: step 5's huge update,
        # averaged into it, is gone, and the ranks' EMAs agree
        assert rb["ema_rollbacks"] == [True], rank
        assert all(torch.isfinite(e).all() for e in rb["ema"]), rank
        assert torch.equal(rb["ema"][0], rb["ema"][1]), rank
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

    base = Path(root)

    def cfg(name: str) -> dict[str, Any]:
        return {"config": rollback_config(base / name)}

    return {
        "clean": train(rank, "fsdp", base / "clean", BATCHES, {}, **cfg("clean")),
        "rollback": train(rank, "fsdp", base / "rb", BATCHES, POISON, **cfg("rb")),
        # snapshots taken at a step's first forward, where FSDP2 unshards the root's own
        # parameters: the step start runs before that unshard (it crashed the forward)
        "root": train(rank, "fsdp_root", base / "root", BATCHES, POISON, **cfg("root")),
    }


@pytest.mark.timeout(90)
def test_fsdp2_rollback_restores_the_shards_on_every_rank(tmp_path: Path) -> None:
    runs = values(run_ranks(_fsdp_job, 2, str(tmp_path), timeout=80))
    for rank, run in enumerate(runs):
        assert run["root"]["error"] is None and run["root"]["finite"] and run["root"]["same"]
        assert run["root"]["step"] == BATCHES - 5
        rb = run["rollback"]
        assert rb["error"] is None
        assert rb["finite"] and rb["same"], f"rank {rank}: params not finite/identical"
        rollbacks = [e for e in rb["events"] if e["kind"] == "rollback"]
        assert [(e["step"], e["restored_step"]) for e in rollbacks] == [(8, 4)]
        assert rollbacks[0]["batches_skipped"] == [4, 5, 6, 7, 8]
        assert rb["step"] == BATCHES - 5
        clean = run["clean"]["eval_loss"]
        assert abs(rb["eval_loss"] - clean) <= 0.25 * clean, (rb["eval_loss"], clean)


# -- the optimizer state after a rollback ------------------------------------------------------

POISON_INF = {5: math.inf}
"""Step 5 applies an infinite update: the moments (Adam) or the momentum buffers (SGD) and the
weights go non-finite, so steps 6-8 are bad and step 8 rolls back to the snapshot of step 4."""
STATEFUL = {"adam": {"step", "exp_avg", "exp_avg_sq"}, "sgd_momentum": {"momentum_buffer"}}
"""The stateful optimizers, and the state each keeps per parameter."""


def _stateful_job(rank: int, world: int, root: str, mode: str) -> dict[str, Any]:

    out = {}
    for name in STATEFUL:
        run_dir = Path(root) / name
        config = rollback_config(run_dir)
        out[name] = train(
            rank,
            mode,
            run_dir,
            BATCHES,
            POISON_INF,
            optimizer=name,
            watch_optimizer=True,
            config=config,
        )
    return out


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two ``optimizer_state`` copies (exact: ``torch.equal``)."""
    diffs = ["param_groups"] if a["groups"] != b["groups"] else []
    for key in sorted(a["state"].keys() | b["state"].keys()):
        x, y = a["state"].get(key), b["state"].get(key)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same = x.dtype == y.dtype and torch.equal(x, y)
        else:
            same = x is not None and x == y
        if not same:
            diffs.append(key)
    return diffs


def _check_restored_optimizer(runs: list[dict[str, Any]], replicated: bool) -> None:
    """Each rank's optimizer state right after the rollback equals what it held when the
    restored step started (its snapshot), bit for bit, with the step counts; the ranks agree
    (replicated state: equal everywhere; FSDP2 shards: the same step counts and settings)."""
    for name, keys in STATEFUL.items():
        for rank, run in enumerate(runs):
            rb = run[name]
            record = rb["optimizer_rollbacks"][0]  # the first rollback (the only one if right)
            assert (record["step"], record["restored"]) == (8, 4), name
            saved, now, before = record["saved"], record["now"], record["before"]
            assert saved is not None and saved["state"], f"{name}: no state at step 4"
            assert {key.split(".", 1)[1] for key in saved["state"]} == keys, name
            assert _differences(before, saved), f"{name}: step 8 had nothing to restore"
            assert _differences(now, saved) == [], f"{name} rank {rank}: state not restored"
            if name == "adam":  # steps 0-3 applied before the snapshot of step 4
                counts = {float(v) for k, v in now["state"].items() if k.endswith(".step")}
                assert counts == {4.0}, (rank, counts)
            rollbacks = [e for e in rb["events"] if e["kind"] == "rollback"]
            assert [(e["step"], e["restored_step"], e["rung"]) for e in rollbacks] == [
                (8, 4, "rollback")
            ], name
            assert len(rb["optimizer_rollbacks"]) == 1, name
            assert rb["error"] is None, (name, rank)
            assert rb["finite"] and rb["same"], f"{name} rank {rank}: params not finite/identical"
            final = rb["optimizer_final"]["state"]
            assert all(torch.isfinite(v).all() for v in final.values()), (name, rank)
        first, *others = runs
        for rank, run in enumerate(others, start=1):
            ours, theirs = run[name]["optimizer_rollbacks"][0]["now"], first[name]
            if replicated:
                assert _differences(ours, theirs["optimizer_rollbacks"][0]["now"]) == []
                assert _differences(run[name]["optimizer_final"], theirs["optimizer_final"]) == []
            else:
                steps = {k for k in ours["state"] if k.endswith(".step")}
                reference = theirs["optimizer_rollbacks"][0]["now"]
                assert ours["groups"] == reference["groups"], (name, rank)
                for key in steps:
                    assert torch.equal(ours["state"][key], reference["state"][key]), (name, key)


@pytest.mark.timeout(90)
def test_ddp_rollback_restores_the_optimizer_state(tmp_path: Path) -> None:
    """Adam (moments, step counts) and SGD with momentum under DDP: the rollback puts back
    the optimizer state of the snapshot, identical on every rank."""
    runs = values(run_ranks(_stateful_job, 2, str(tmp_path), "ddp", timeout=80))
    _check_restored_optimizer(runs, replicated=True)


@pytest.mark.timeout(90)
def test_fsdp2_rollback_restores_the_optimizer_state_shards(tmp_path: Path) -> None:
    """The same under FSDP2: every rank gets back its own shard of the moments."""
    runs = values(run_ranks(_stateful_job, 2, str(tmp_path), "fsdp", timeout=80))
    _check_restored_optimizer(runs, replicated=False)


def _zero_job(rank: int, world: int, root: str) -> dict[str, Any]:

    run_dir = Path(root) / "zero"
    config = rollback_config(run_dir)
    out = train(rank, "ddp", run_dir, BATCHES, POISON_INF, optimizer="zero_adam", config=config)
    out["captures"] = sorted(p.name for p in (run_dir / "captures").glob("step-*"))
    out["failed"] = [e for e in read_events(run_dir, rank) if e["kind"] == "capture_failed"]
    return out


@pytest.mark.timeout(90)
def test_zero_redundancy_optimizer_rolls_back_and_captures(tmp_path: Path) -> None:
    """ZeroRedundancyOptimizer's state_dict() is a collective (it raises unless consolidated):
    the snapshots and captures hold each rank's own shard, and the rollback restores it."""
    runs = values(run_ranks(_zero_job, 2, str(tmp_path), timeout=80))
    for rank, run in enumerate(runs):
        assert run["error"] is None, rank
        rollbacks = [e for e in run["events"] if e["kind"] == "rollback"]
        assert [(e["step"], e["restored_step"]) for e in rollbacks] == [(8, 4)], rank
        assert run["finite"] and run["same"], f"rank {rank}: params not finite/identical"
        assert run["step"] == BATCHES - 5
        assert run["failed"] == [] and "step-00000006" in run["captures"], rank
