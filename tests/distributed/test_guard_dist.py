"""The guard across real processes (gloo): every rank takes the same decision.

Each spawned job runs several scenarios in sequence, so the process start-up cost is paid
once; a scenario that left any rank behind would hang the next collective and fail the test
on its deadline.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tg_dist import cpu_fully_shard, run_ranks, values
from tg_models import TinyNet, loss_fn, make_batches
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from trainguard.testing import Fault, FaultPlan

FAULTS = [
    Fault(step=2, rank=1, where="loss"),  # NaN loss on one rank
    Fault(step=4, rank=0, where="loss", value=float("inf")),  # Inf loss on one rank
    Fault(step=6, rank=1, where="grad", param="encoder.fc.weight"),  # NaN in one rank's grad
]
BAD_STEPS = [2, 4, 6]
STEPS = 9


def _wrap(model: TinyNet, mode: str) -> torch.nn.Module:
    if mode == "ddp":
        return DDP(model)
    cpu_fully_shard(model.encoder, model.head, model)
    return model


def _full_params(model: torch.nn.Module) -> torch.Tensor:
    tensors = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: all-gather
        tensors.append(full.detach().reshape(-1))
    return torch.cat(tensors)


def _optimizer_summary(opt: torch.optim.Optimizer) -> dict[str, Any]:
    finite = True
    steps = []
    for state in opt.state.values():
        for key, value in state.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            finite &= bool(torch.isfinite(local).all())
            if key == "step":
                steps.append(float(local))
    return {"finite": finite, "steps": steps}


def _train(
    rank: int, mode: str, run_dir: Path, faults: list[Fault], data: list[Any], **kw: Any
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _wrap(TinyNet(), mode)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = tg.Guard(model, opt, run_dir=run_dir, **kw)
    plan = FaultPlan(faults)
    results: list[bool] = []
    error: dict[str, Any] | None = None
    try:
        for batch in guard.watch(data):
            step = guard.state.step
            loss = plan.loss(loss_fn(model, batch), step)
            loss.backward()
            plan.grads(model, step)
            results.append(guard.check(loss))
            opt.step()
            opt.zero_grad()
    except tg.NonFiniteError as exc:
        error = {"step": exc.step, "ranks": exc.ranks, "time": time.monotonic()}
    guard.close()
    return {
        "results": results,
        "error": error,
        "params": _full_params(model),
        "optimizer": _optimizer_summary(opt),
        "state": guard.state.state_dict(),
    }


def _fused(rank: int, run_dir: Path) -> dict[str, Any]:
    """Sync-free guard.step() with fused AdamW, faults on one rank, uneven data."""
    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    plan = FaultPlan(FAULTS)
    steps = 0
    with tg.Guard(model, opt, run_dir=run_dir, grad_clip=0.5) as guard:
        for batch in guard.watch(make_batches([9, 8, 12][rank], seed=rank)):
            loss = plan.loss(loss_fn(model, batch), guard.state.step)
            loss.backward()
            plan.grads(model, guard.state.step)
            guard.step(loss)
            steps += 1
    return {
        "steps": steps,
        "params": _full_params(model),
        "optimizer": _optimizer_summary(opt),
        "bad": list(guard.state.nonfinite_steps),
    }


def _accumulation(rank: int, run_dir: Path) -> list[bool]:
    """DDP with no_sync on the inner micro-batches; a bad loss in one micro-batch on rank 1."""
    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, run_dir=run_dir, accumulation_steps=2)
    results = []
    for i, batch in enumerate(guard.watch(make_batches(8, seed=rank))):
        last = (i + 1) % 2 == 0
        with nullcontext() if last else model.no_sync():
            loss = loss_fn(model, batch) / 2
            if rank == 1 and i == 2:  # first micro-batch of step 1: bad loss, finite grads
                loss = loss + float("nan")
            loss.backward()
        guard.record_loss(loss)
        if last:
            results.append(guard.check())  # the recorded losses: NaN on rank 1 at step 1
            opt.step()
            opt.zero_grad()
    return results


def _ddp_job(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    data = make_batches(STEPS, seed=10 + rank)
    out: dict[str, Any] = {}
    out["skip"] = _train(rank, "ddp", base / "skip", FAULTS, data)
    raise_faults = [Fault(step=3, rank=world - 1)]
    out["raise"] = _train(rank, "ddp", base / "raise", raise_faults, data, on_nonfinite="raise")
    out["raise"]["done"] = time.monotonic()
    streak = [Fault(step=s, rank=1) for s in (2, 3, 4)]
    out["escalate"] = _train(rank, "ddp", base / "escalate", streak, data, max_consecutive=3)
    uneven = make_batches([5, 3, 7][rank], seed=rank)
    out["uneven"] = _train(rank, "ddp", base / "uneven", [], uneven)
    out["empty"] = _train(rank, "ddp", base / "empty", [], [] if rank == 2 else data)
    out["accumulation"] = _accumulation(rank, base / "accumulation")
    out["fused"] = _fused(rank, base / "fused")
    dist.barrier()
    return out


def _fsdp_job(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    data = make_batches(STEPS, seed=10 + rank)
    out: dict[str, Any] = {}
    out["skip"] = _train(rank, "fsdp", base / "skip", FAULTS, data)
    raise_faults = [Fault(step=1, rank=1, where="grad", param="head.weight")]
    out["raise"] = _train(rank, "fsdp", base / "raise", raise_faults, data, on_nonfinite="raise")
    return out


def _assert_same_everywhere(runs: list[dict[str, Any]], key: str) -> None:
    first = runs[0][key]
    for rank, run in enumerate(runs):
        assert run[key] == first, f"rank {rank} {key}={run[key]} vs rank 0 {first}"


def _assert_skip_scenario(runs: list[dict[str, Any]], run_dir: Path) -> None:
    expected = [step not in BAD_STEPS for step in range(STEPS)]
    for run in runs:
        assert run["results"] == expected  # same answer, same steps, every rank
        assert torch.isfinite(run["params"]).all()
        assert run["optimizer"]["finite"]
        assert run["optimizer"]["steps"] == [float(STEPS - len(BAD_STEPS))] * len(
            run["optimizer"]["steps"]
        )
        assert run["state"]["nonfinite_steps"] == BAD_STEPS
    for run in runs[1:]:
        assert torch.equal(run["params"], runs[0]["params"])
    for rank in range(len(runs)):
        events = tg.read_events(run_dir, rank=rank)
        bad = [(e["step"], e["where"], e["ranks"]) for e in events if e["kind"] == "nonfinite"]
        assert bad == [(2, "loss", [1]), (4, "loss", [0]), (6, "grad", [1])]
    grad_event = [e for e in tg.read_events(run_dir, rank=1) if e["kind"] == "nonfinite"][-1]
    assert grad_event["params"] == ["encoder.fc.weight"]


@pytest.mark.timeout(150)
def test_ddp_three_ranks(tmp_path: Path) -> None:
    runs = values(run_ranks(_ddp_job, 3, str(tmp_path), timeout=140))
    _assert_skip_scenario([r["skip"] for r in runs], tmp_path / "skip")

    raised = [r["raise"] for r in runs]
    assert [r["error"]["step"] for r in raised] == [3, 3, 3]
    assert [r["error"]["ranks"] for r in raised] == [[2], [2], [2]]
    assert all(r["results"] == [True, True, True] for r in raised)
    assert all(r["done"] - r["error"]["time"] < 5.0 for r in raised)

    escalated = [r["escalate"] for r in runs]
    assert [r["error"]["step"] for r in escalated] == [4, 4, 4]
    for rank in range(3):
        kinds = [(e["kind"], e["step"]) for e in tg.read_events(tmp_path / "escalate", rank)]
        assert ("escalate", 4) in kinds

    uneven = [r["uneven"] for r in runs]
    assert [len(r["results"]) for r in uneven] == [3, 3, 3]
    for rank in range(3):
        events = tg.read_events(tmp_path / "uneven", rank)
        (event,) = [e for e in events if e["kind"] == "uneven_data"]
        assert event["exhausted_ranks"] == [1]
        assert event["batches"][1] == 3 and min(event["batches"]) == 3
    for run in uneven[1:]:
        assert torch.equal(run["params"], uneven[0]["params"])

    assert [len(r["empty"]["results"]) for r in runs] == [0, 0, 0]
    assert [r["accumulation"] for r in runs] == [[True, False, True, True]] * 3

    fused = [r["fused"] for r in runs]
    assert [r["steps"] for r in fused] == [8, 8, 8]  # rank 1 holds 8 batches: all stop there
    assert [r["bad"] for r in fused] == [BAD_STEPS] * 3
    assert all(r["optimizer"]["steps"] == [5.0] * 4 for r in fused)  # 8 steps, 3 skipped
    for run in fused:
        assert torch.isfinite(run["params"]).all() and run["optimizer"]["finite"]
        assert torch.equal(run["params"], fused[0]["params"])
    for rank in range(3):
        (event,) = [
            e for e in tg.read_events(tmp_path / "fused", rank) if e["kind"] == "uneven_data"
        ]
        assert event["exhausted_ranks"] == [1] and event["steps"] == 8


@pytest.mark.timeout(120)
def test_fsdp2_two_ranks(tmp_path: Path) -> None:
    runs = values(run_ranks(_fsdp_job, 2, str(tmp_path), timeout=110))
    _assert_skip_scenario([r["skip"] for r in runs], tmp_path / "skip")
    raised = [r["raise"] for r in runs]
    # The NaN sits in rank 1's shard only; rank 0's shard is finite, and it stops all the same.
    assert [r["error"]["ranks"] for r in raised] == [[1], [1]]
    assert [r["error"]["step"] for r in raised] == [1, 1]
