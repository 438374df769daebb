"""Every decision from agreed data (issue 52): ranks whose own state differs decide alike.

A property test over real processes (gloo, 2 and 4 ranks, DDP): each rank has its own RNG
stream (dropout), its own step time (the last rank is slower), its own GradScaler scale (a
different ``init_scale`` per rank) and, at one step, its own learning rate (rank 1's LR
jumps x1000 for one step: a one-rank weight wreck, as a scheduler fault or a bad resume
makes). Under ``on_spike`` "skip" and "rollback", with and without a scaler, and with the
sync-free step: every rank writes the same decision events at the same steps, records the
same decision for every step, ends the same way (the same error at the same step, or
none), nobody hangs, and the weights are identical on every rank after every rollback.

Before the rules read agreed data only, rank 1 (whose own LR had jumped) sat in the spike
rule's LR grace while the others judged the wreck a spike: they rolled back alone (a
collective mismatch, a hang) or skipped alone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tg_dist import run_ranks, values
from tg_models import TinyNet
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg

STEPS = 36
JUMP_STEP = 22
"""The step at which rank 1's learning rate jumps, once."""
LR = 1e-3
PER_RANK = {"time", "rank", "bundle", "seconds", "path", "buffers_restored", "run"}
"""Event fields that may differ between ranks (when, who, where on disk, how long)."""
DECIDING = {
    "skip",
    "spike",
    "nonfinite",
    "escalate",
    "rollback",
    "overflow",
    "dropped",
    "lr_mismatch",
    "straggler",
    "replica_divergence",
}
"""Event kinds that follow from a decision (every rank writes them alike)."""

CASES = [
    ("skip", False, False),
    ("skip", True, False),
    ("skip", False, True),
    ("rollback", False, False),
    ("rollback", True, False),
]
"""(on_spike, with a GradScaler of its own scale per rank, the sync-free step)"""


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _train(rank: int, world: int, run_dir: Path, case: tuple[str, bool, bool]) -> dict[str, Any]:
    on_spike, scaled, sync_free = case
    torch.manual_seed(0)  # the same initial weights
    model = DDP(TinyNet())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=sync_free)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (8 + rank)) if scaled else None
    config = tg.GuardConfig(
        run_dir=run_dir,
        on_spike=on_spike,  # type: ignore[arg-type]
        on_escalation="rollback" if on_spike == "rollback" else "raise",
        hang_timeout=0,
        replica_check_every=0,
        spikes=tg.SpikeConfig(warmup=12),
        recovery=tg.RecoveryConfig(snapshot_every=4),
        health=tg.HealthConfig(straggler_warmup=4),
    )
    guard = tg.Guard(model, opt, scaler=scaler, config=config)
    torch.manual_seed(100 + rank)  # each rank's own RNG stream (dropout)
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randn(6, 8, generator=gen) for _ in range(STEPS)]
    jumped, error, rollbacks, at_start = False, None, [], {}
    try:
        for x in guard.watch(data):
            at_start.setdefault(guard.global_step, _flat(model))
            lr = LR
            if rank == 1 and guard.global_step == JUMP_STEP and not jumped:
                lr, jumped = LR * 1000, True  # this rank's own LR, for one step
            for group in opt.param_groups:
                group["lr"] = lr
            if rank == world - 1:
                time.sleep(0.004)  # its own step time
            loss = (F.dropout(model(x), 0.1) - 1.0).pow(2).mean()
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if sync_free:
                guard.step(loss)
            else:
                ok = guard.check(loss)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                elif ok:
                    opt.step()
                opt.zero_grad()
            if guard.recovery is not None and guard.recovery.state.rollbacks > len(rollbacks):
                step = guard.global_step
                rollbacks.append((step, _flat(model), torch.equal(_flat(model), at_start[step])))
        guard.close()
    except tg.TrainGuardError as exc:
        error = (type(exc).__name__, exc.step)
        guard.close()
    lines = (run_dir / "events" / f"rank-{rank}.jsonl").read_text().splitlines()
    events = [
        (e["step"], e["kind"], {k: v for k, v in e.items() if k not in PER_RANK})
        for e in map(json.loads, lines)
        if e["kind"] in DECIDING
    ]
    return {
        "events": events,
        "decisions": [(r.step, r.decision) for r in guard.history.records()],
        "error": error,
        "rollbacks": rollbacks,
        "params": _flat(model),
    }


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    return {
        case: _train(rank, world, Path(root) / "-".join(map(str, case)), case) for case in CASES
    }


def _check(ranks: list[dict[Any, dict[str, Any]]]) -> None:
    for case in CASES:
        runs = [r[case] for r in ranks]
        first = runs[0]
        kinds = {kind for _, kind, _ in first["events"]}
        assert "lr_mismatch" in kinds, case  # rank 1's LR was seen, agreed, on every rank
        assert [s for s, k, _ in first["events"] if k == "lr_mismatch"] == [JUMP_STEP], case
        assert "spike" in kinds, case  # the wreck was judged a spike ...
        for run in runs[1:]:  # ... and everything decided alike, on every rank
            assert run["events"] == first["events"], case
            assert run["decisions"] == first["decisions"], case
            assert run["error"] == first["error"], case
            assert len(run["rollbacks"]) == len(first["rollbacks"]), case
        on_spike = case[0]
        if on_spike == "rollback":
            assert first["rollbacks"], case
            for index in range(len(first["rollbacks"])):
                assert len({run["rollbacks"][index][0] for run in runs}) == 1, case
                for run in runs:  # every rank holds again what it held at that step
                    assert run["rollbacks"][index][2], case
                if case[1]:
                    continue  # scales of their own: DDP's replicas differ by design
                for run in runs[1:]:  # the wreck is undone: identical replicas again
                    assert torch.equal(run["rollbacks"][index][1], first["rollbacks"][index][1])
            if not case[1]:
                for run in runs[1:]:
                    assert torch.equal(run["params"], first["params"]), case
        else:  # the wreck stays on rank 1: spikes in a row end the run, on every rank alike
            assert "skip" in kinds, case
            assert first["error"] is not None and first["error"][0] == "SpikeError", case


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_whose_own_state_differs_decide_alike(tmp_path: Path, world: int) -> None:
    _check(values(run_ranks(_job, world, str(tmp_path), timeout=220, pg_timeout=60)))
