"""Resume across restarts: torchrun kills and restarts a job, damaged checkpoints fall back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import free_port, run_ranks, values
from tg_recovery import train

SCRIPT = Path(__file__).parent / "scripts" / "recovery_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _torchrun(run_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        str(TORCHRUN),
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(SCRIPT),
        str(run_dir),
        str(out),
        *extra,
    ]
    # A fresh rendezvous store per restart: with the agent's shared store a restarted gloo group
    # reads the killed attempt's addresses (pytorch/pytorch#135712; trainguard.distributed.elastic).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    except subprocess.TimeoutExpired as exc:  # say where it stood
        tail = (exc.stderr or b"")[-4000:]
        raise AssertionError(f"torchrun did not finish in 150 s: {tail!r}") from exc


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    from trainguard.events import read_events

    return [e for e in read_events(run_dir) if e["kind"] == kind]


@pytest.mark.timeout(330)
def test_torchrun_restart_resumes_bitwise(tmp_path: Path) -> None:
    plain = _torchrun(tmp_path / "plain", tmp_path / "plain.pt")
    assert plain.returncode == 0, plain.stderr[-3000:]
    killed = _torchrun(
        tmp_path / "killed", tmp_path / "killed.pt", "--kill-at", "11", "--no-failure-state"
    )
    assert killed.returncode == 0, killed.stderr[-3000:]
    resumes = [e for e in _events(tmp_path / "killed", "resume") if e.get("from_step")]
    assert {e["rank"] for e in resumes} == {0, 1}
    assert {(e["from_step"], e["epoch"], e["position"]) for e in resumes} == {(9, 1, 1)}
    assert not _events(tmp_path / "killed", "restart_config")  # the store is not shared
    a = torch.load(tmp_path / "plain.pt")
    b = torch.load(tmp_path / "killed.pt")
    assert a["step"] == b["step"] == 16
    assert torch.equal(a["params"], b["params"]), "resumed weights differ from the plain run"


def _damaged_job(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    import trainguard as tg

    run_dir = Path(root) / "run"
    config = tg.GuardConfig(
        run_dir=run_dir,
        checkpoint_every=2,
        hang_timeout=0,
        recovery=tg.RecoveryConfig(good_after=1),
    )
    train(rank, "ddp", run_dir, 9, {}, config=config)
    good = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    if rank == 0:  # damage the newest: truncate its data files
        for data in (run_dir / "checkpoints" / good[-1]).glob("*.distcp"):
            data.write_bytes(data.read_bytes()[:10])
    dist.barrier()
    again = tg.GuardConfig(run_dir=run_dir, checkpoint_every=2, resume=True, hang_timeout=0)
    resumed = train(rank, "ddp", run_dir, 0, {}, config=again)
    return {"good": good, **resumed}


@pytest.mark.timeout(90)
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path) -> None:
    runs = values(run_ranks(_damaged_job, 2, str(tmp_path), timeout=80))
    for rank, run in enumerate(runs):
        assert run["good"] == ["step-00000004", "step-00000006", "step-00000008"]
        kinds = [e["kind"] for e in run["events"]]
        damaged = [e for e in run["events"] if e["kind"] == "checkpoint_damaged"]
        assert [e["step"] for e in damaged] == [8], f"rank {rank}: {kinds}"
        resumed = [e for e in run["events"] if e["kind"] == "resume"]
        assert resumed[-1]["from_step"] == 6
        assert run["step"] == 6 and run["same"] and run["finite"]


def _buffers_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each rank's BatchNorm statistics differ (DDP keeps each rank's own): a checkpoint
    saved and loaded gives every rank back its own, not one rank's for all."""
    import torch.distributed as dist
    from torch import nn

    from trainguard.recovery import checkpoint as ckpt
    from trainguard.recovery.snapshot import TrainingObjects

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    objects = TrainingObjects(model, torch.optim.SGD(model.parameters(), lr=0.1))
    bn = model.module[1]
    bn.running_mean.fill_(rank + 1.0)
    bn.running_var.fill_(10.0 * (rank + 1))
    group = dist.group.WORLD
    ckpt.save(Path(root), 2, objects, {}, group, rank)
    bn.running_mean.zero_()
    bn.running_var.fill_(1.0)
    ckpt.load(ckpt.step_dir(Path(root), 2), objects, rank)
    return {"mean": bn.running_mean.tolist(), "var": bn.running_var.tolist()}


@pytest.mark.timeout(60)
def test_a_checkpoint_gives_each_rank_back_its_own_buffers(tmp_path: Path) -> None:
    ranks = values(run_ranks(_buffers_job, 2, str(tmp_path), timeout=50))
    for rank, got in enumerate(ranks):
        assert got == {"mean": [rank + 1.0] * 4, "var": [10.0 * (rank + 1)] * 4}, rank
