"""Replica agreement across 4 real processes (gloo, DDP): a weight nudged on one rank is
named within ``replica_check_every`` steps on every rank, and ``on_divergence`` acts the
same way everywhere (warn, resync to bit-identical state, raise at the same step).

One spawned job runs every scenario in sequence (the process start-up is paid once). Every
rank trains on the same batches with ``broadcast_buffers=False``, so the BatchNorm buffers
evolve identically and a resync has buffers of its own to repair.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import run_ranks, values
from tg_models import make_batches
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from trainguard.testing import poison_loss

WORLD = 4
EVERY = 4
ODD_RANK = 2
PARAM = "fc.weight"


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(torch.tanh(self.bn(self.fc(x))))
        return out


def _nudge(rank: int, step: int, fault_step: int | None, model: BNNet, opt: Any) -> None:
    """On the odd rank only: +1e-3 on one weight, its BN buffer and its Adam moment."""
    if rank != ODD_RANK or step != fault_step:
        return
    with torch.no_grad():
        model.fc.weight[3, 5].add_(1e-3)
        model.bn.running_mean[3].add_(1e-3)
        state = opt.state.get(model.fc.weight, {})
        if "exp_avg" in state:
            state["exp_avg"][3, 5].add_(1e-3)


def _state(model: BNNet, opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for key, value in opt.state[p].items():
            tensors[f"opt.{i}.{key}"] = value.detach().clone()
    return tensors


def _run(
    rank: int,
    run_dir: Path,
    fault_step: int | None,
    steps: int = 12,
    fused: bool = False,
    nan_calls: tuple[int, ...] = (),
    **kw: Any,
) -> dict[str, Any]:
    torch.manual_seed(0)
    inner = BNNet()
    model = DDP(inner, broadcast_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    error = None
    guard = tg.Guard(model, opt, run_dir=run_dir, replica_check_every=EVERY, **kw)
    try:
        for call, batch in enumerate(guard.watch(make_batches(steps, seed=0))):
            _nudge(rank, guard.state.step, fault_step, inner, opt)
            loss = model(batch).pow(2).mean()
            if call in nan_calls and rank == 0:
                loss = poison_loss(loss)
            loss.backward()
            if fused:
                guard.step(loss)
                continue
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    except tg.ReplicaDivergenceError as exc:
        error = {"step": exc.step, "ranks": exc.ranks, "params": exc.params}
    finally:
        guard.close()
    return {"state": _state(inner, opt), "error": error, "diverged_at": guard.replicas.diverged_at}


WRECK_STEP = 7
"""The step whose update the odd rank takes at 50x its learning rate (a finite wreck)."""


def _wreck(rank: int, run_dir: Path) -> dict[str, Any]:
    """A one-rank finite weight wreck (its LR x50 for one update) under the default options:
    the replicas must be seen to differ within the default cadence."""
    torch.manual_seed(0)
    inner = BNNet()
    model = DDP(inner, broadcast_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = tg.Guard(model, opt, run_dir=run_dir)
    default_every = guard.config.health.replica_check_every
    try:
        for batch in guard.watch(make_batches(14, seed=0)):
            wrecked = rank == ODD_RANK and guard.state.step == WRECK_STEP
            loss = model(batch).pow(2).mean()
            loss.backward()
            if guard.check(loss):
                opt.param_groups[0]["lr"] = 0.5 if wrecked else 1e-2
                opt.step()
                opt.param_groups[0]["lr"] = 1e-2
            opt.zero_grad()
    finally:
        guard.close()
    return {"every": default_every, "diverged_at": guard.replicas.diverged_at}


class EmaTask(nn.Module):
    """timm's training task: the DDP-wrapped network beside an EMA copy that each rank made
    from its own initialization (timm seeds each rank differently) before the wrap."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(rank)
        self.ema = BNNet().requires_grad_(False)
        torch.manual_seed(0)
        self.ddp = DDP(BNNet(), broadcast_buffers=False)

    @property
    def inner(self) -> BNNet:
        inner: BNNet = self.ddp.module
        return inner

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.ddp(x)
        return out

    @torch.no_grad()
    def update_ema(self) -> None:
        for ema, weight in zip(self.ema.parameters(), self.inner.parameters(), strict=True):
            ema.lerp_(weight, 0.1)


def _ema(rank: int, run_dir: Path) -> dict[str, Any]:
    """The guard over the whole task, as ``trainguard run`` finds timm's: the EMA copies
    differ across ranks from the start and are no replicas; a nudge inside DDP is named."""
    task = EmaTask(rank)
    opt = torch.optim.AdamW(task.ddp.parameters(), lr=1e-2)
    guard = tg.Guard(task, opt, run_dir=run_dir, replica_check_every=EVERY)
    try:
        for batch in guard.watch(make_batches(12, seed=0)):
            _nudge(rank, guard.state.step, 8, task.inner, opt)
            loss = task(batch).pow(2).mean()
            loss.backward()
            if guard.check(loss):
                opt.step()
                task.update_ema()
            opt.zero_grad()
    finally:
        guard.close()
    return {f"ema.{k}": v.clone() for k, v in task.ema.named_parameters()}


def _own_models(rank: int, run_dir: Path) -> bool:
    """PyTorch's ImageNet example on CPU with ``--seed``: no DDP, the same initial weights on
    every rank, each rank's own batches and nothing averaging the gradients. Equal at the
    check of step 0, apart at step 4: taken for no replicas (the guard's answer)."""
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = tg.Guard(model, opt, run_dir=run_dir, replica_check_every=EVERY)
    try:
        for batch in guard.watch(make_batches(12, seed=rank)):
            loss = model(batch).pow(2).mean()
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    finally:
        guard.close()
    return guard.replicas.no_replicas


def _job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    base = Path(root)
    return {
        "wreck": _wreck(rank, base / "wreck"),
        "healthy": _run(rank, base / "healthy", None),
        "ema": _ema(rank, base / "ema"),
        "own": _own_models(rank, base / "own"),
        "warn": _run(rank, base / "warn", 8),
        "resync": _run(rank, base / "resync", 8, on_divergence="resync"),
        "raise": _run(rank, base / "raise", 8, on_divergence="raise"),
        # the sync-free guard.step() reads each agreement a step late; off-cadence fault
        "fused": _run(rank, base / "fused", 9, steps=16, fused=True, on_divergence="resync"),
        # resynced at the check of step 8, then bad steps 10, 11: the rollback goes to step
        # 8's snapshot, taken before the resync (the odd rank's holds its nudged weights)
        "rollback": _run(
            rank,
            base / "rollback",
            5,
            steps=18,
            nan_calls=(10, 11),
            on_divergence="resync",
            on_escalation="rollback",
            recovery=tg.RecoveryConfig(snapshot_every=2),
            max_consecutive=2,
        ),
    }


def _divergences(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    return [e for e in tg.read_events(run_dir, rank) if e["kind"] == "replica_divergence"]


def _identical(states: list[dict[str, Tensor]]) -> list[str]:
    """Names of the tensors that are not bit-identical on every rank."""
    first = states[0]
    return [k for k in first if not all(torch.equal(s[k], first[k]) for s in states[1:])]


@pytest.mark.timeout(120)
def test_replica_divergence_four_ranks(tmp_path: Path) -> None:
    runs = values(run_ranks(_job, WORLD, str(tmp_path), timeout=110))

    for rank in range(WORLD):  # the default cadence sees a finite one-rank wreck in a few steps
        wreck = runs[rank]["wreck"]
        assert wreck["every"] <= 5
        (event,) = _divergences(tmp_path / "wreck", rank)[:1]
        assert WRECK_STEP < event["step"] <= WRECK_STEP + wreck["every"]
        assert event["ranks"] == [ODD_RANK] and wreck["diverged_at"] == event["step"]

    for rank in range(WORLD):  # healthy: checked at 0, 4, 8, never differs
        assert _divergences(tmp_path / "healthy", rank) == []
        assert runs[rank]["healthy"]["diverged_at"] is None
    assert _identical([r["healthy"]["state"] for r in runs]) == []

    for rank in range(WORLD):  # an EMA copy beside DDP: never a divergence; the nudge inside is
        (event,) = _divergences(tmp_path / "ema", rank)
        assert (event["step"], event["ranks"]) == (8, [ODD_RANK])
        assert event["params"] == [f"ddp.module.{PARAM}"] and event["params_differing"] == 1
    emas = [r["ema"] for r in runs]  # and the copies still differ on every rank
    assert {"ema.fc.weight", "ema.fc.bias", "ema.head.weight"} <= set(_identical(emas))

    for rank in range(WORLD):  # models of their own: said once, at step 4, on every rank
        (event,) = _divergences(tmp_path / "own", rank)
        assert (event["step"], event["tie"], event["no_replicas"]) == (4, True, True)
        assert event["ranks"] == list(range(WORLD)) and runs[rank]["own"] is True

    for rank in range(WORLD):  # warn: named on every rank at the fault's check
        (event,) = _divergences(tmp_path / "warn", rank)
        assert event["step"] == 8 and event["ranks"] == [ODD_RANK]
        assert event["params"] == [PARAM] and event["majority_rank"] == 0
        assert event["action"] == "warn" and event["tie"] is False
        assert runs[rank]["warn"]["diverged_at"] == 8
    drifted = _identical([r["warn"]["state"] for r in runs])
    assert {"model.fc.weight", "model.bn.running_mean", "opt.0.exp_avg"} <= set(drifted)

    for rank in range(WORLD):  # resync: repaired at 8, all state bit-identical after
        (event,) = _divergences(tmp_path / "resync", rank)
        assert (event["step"], event["ranks"], event["action"]) == (8, [ODD_RANK], "resync")
    assert _identical([r["resync"]["state"] for r in runs]) == []

    errors = [r["raise"]["error"] for r in runs]  # raise: every rank, same step
    assert errors == [{"step": 8, "ranks": [ODD_RANK], "params": [PARAM]}] * WORLD
    for rank in range(WORLD):
        assert [e["action"] for e in _divergences(tmp_path / "raise", rank)] == ["raise"]

    for rank in range(WORLD):  # sync-free: fault at 9, named at the check of 12
        (event,) = _divergences(tmp_path / "fused", rank)
        assert 9 <= event["step"] < 9 + EVERY and event["ranks"] == [ODD_RANK]
        assert event["params"] == [PARAM]
    assert _identical([r["fused"]["state"] for r in runs]) == []

    for rank in range(WORLD):  # a resync, then a rollback to before it: resynced again
        (event,) = _divergences(tmp_path / "rollback", rank)  # none at the checks after it
        assert (event["step"], event["action"]) == (8, "resync")
        events = tg.read_events(tmp_path / "rollback", rank)
        (rollback,) = [e for e in events if e["kind"] == "rollback"]
        assert rollback["restored_step"] == 8  # the snapshot from before the resync
    assert _identical([r["rollback"]["state"] for r in runs]) == []
