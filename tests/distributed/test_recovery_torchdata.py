"""Resume with torchdata's StatefulDataLoader across real processes (2 ranks, gloo, DDP): each
rank's checkpoint part holds its own loader state, and a fresh guard with ``resume=True``
continues bitwise as an uninterrupted run, also after a rollback skipped batches."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from tg_dist import run_ranks, values

pytest.importorskip("torchdata.stateful_dataloader")

EPOCHS = 3
BATCHES = 8  # per rank and epoch: 32 samples, 2 ranks, batch size 2


def _loader(rank: int) -> Any:
    import torch
    from torch.utils.data import DistributedSampler, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    rows = torch.arange(32, dtype=torch.float32)[:, None].repeat(1, 8)  # sample i: a row of i's
    dataset = TensorDataset(rows)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=3)
    return StatefulDataLoader(dataset, batch_size=2, sampler=sampler)


def _batch_at(rank: int, epoch: int, position: int) -> set[int]:
    """The samples of this rank's batch at ``position`` of ``epoch`` (to poison it)."""
    loader = _loader(rank)
    loader.sampler.set_epoch(epoch)
    batch = list(loader.batch_sampler)[position]
    return {int(i) for i in batch}


def _train(
    rank: int,
    run_dir: Path,
    crash_at: int | None = None,
    crash_epoch: int = 0,
    poison: frozenset[int] = frozenset(),
    **options: Any,
) -> dict[str, Any]:
    """``EPOCHS`` epochs of DDP; ``crash_at``: leave before that step (first reached in
    ``crash_epoch`` or later: a rollback takes steps again); a batch of epoch 1
    holding a ``poison`` sample gets a huge finite update (later losses are Inf until a
    rollback)."""
    import torch
    import torch.distributed as dist
    from tg_models import TinyNet
    from tg_recovery import full_params
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainguard as tg
    from trainguard.events import read_events

    torch.manual_seed(0)
    model = DDP(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = tg.GuardConfig.from_options(
        {"run_dir": run_dir, "hang_timeout": 0, "recovery.good_after": 1, **options}
    )
    guard = tg.Guard(model, opt, config=config)
    loader = _loader(rank)
    seen: list[list[int]] = []
    with guard, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for epoch in range(EPOCHS):
            loader.sampler.set_epoch(epoch)
            for (x,) in guard.watch(loader):
                if guard.state.step == crash_at and epoch >= crash_epoch:
                    return {"seen": seen}
                samples = [int(v) for v in x[:, 0]]
                seen.append([epoch, *samples])
                loss = nn.functional.mse_loss(model(x / 32), x[:, :4] / 32)
                loss.backward()
                if guard.check(loss):
                    if epoch == 1 and poison.intersection(samples):
                        for p in model.parameters():
                            p.grad.fill_(1e37)  # type: ignore[union-attr]
                    opt.step()
                opt.zero_grad(set_to_none=True)
    params = full_params(model)
    gathered = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    kinds = {"resume", "rollback", "checkpoint"}
    return {
        "seen": seen,
        "params": params,
        "same": all(torch.equal(gathered[0], g) for g in gathered),
        "step": guard.state.step,
        "events": [e for e in read_events(run_dir, rank) if e["kind"] in kinds],
    }


def _loader_part(run_dir: Path, step: int, rank: int) -> dict[str, Any]:
    import torch

    part = run_dir / "checkpoints" / f"step-{step:08d}" / f"rank-{rank}.pt"
    data: dict[str, Any] = torch.load(part, weights_only=False)["data"]
    return data


def _resume_job(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    whole = _train(rank, base / "whole", checkpoint_every=3)
    _train(rank, base / "crashed", crash_at=11, checkpoint_every=3)
    saved = _loader_part(base / "crashed", 9, rank)
    again = _train(rank, base / "crashed", checkpoint_every=3, resume=True)
    return {"whole": whole, "again": again, "saved": saved}


@pytest.mark.timeout(150)
def test_stateful_loader_resume_continues_bitwise_on_every_rank(tmp_path: Path) -> None:
    runs = values(run_ranks(_resume_job, 2, str(tmp_path), timeout=140))
    for rank, run in enumerate(runs):
        whole, again = run["whole"], run["again"]
        saved = run["saved"]  # this rank's part: the state at step 9 (epoch 1, 1 batch in)
        assert (saved["epoch"], saved["position"]) == (1, 1)
        assert saved["loader"]["_num_yielded"] == 1, f"rank {rank}: state not at the boundary"
        resumed = [e for e in again["events"] if e["kind"] == "resume"][-1]
        assert (resumed["from_step"], resumed["epoch"], resumed["position"]) == (9, 1, 1)
        assert resumed["loader_state"] is True
        assert whole["step"] == again["step"] == EPOCHS * BATCHES
        assert again["seen"] == whole["seen"][9:], f"rank {rank}: other batches after resume"
        assert whole["same"] and again["same"], f"rank {rank}: ranks differ"
        assert whole["params"].equal(again["params"]), f"rank {rank}: resumed weights differ"
    assert runs[0]["whole"]["seen"] != runs[1]["whole"]["seen"]  # each rank its own shard


def _rollback_job(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    poison = frozenset(_batch_at(rank, 1, 3))  # step 11: epoch 1, batch 3
    options: dict[str, Any] = {
        "checkpoint_every": 6,
        "recovery.snapshot_every": 2,
        "on_escalation": "rollback",
        "max_consecutive": 2,
        "poison": poison,
    }
    whole = _train(rank, base / "whole", **options)
    _train(rank, base / "crashed", crash_at=12, crash_epoch=2, **options)
    again = _train(rank, base / "crashed", resume=True, **options)
    return {"whole": whole, "again": again, "poison": sorted(poison)}


@pytest.mark.timeout(150)
def test_stateful_loader_resume_after_a_rollback_skips_the_ledger_batches(tmp_path: Path) -> None:
    """Poisoned step 11 (epoch 1, batch 3): steps 12, 13 are Inf, the guard rolls back to the
    snapshot of step 10 and skips batches 2-5 of epoch 1. The first attempt stops at step 12
    again (epoch 2, after the rollback), before its next checkpoint is good; the resume loads
    step 6's (epoch 0) and must drop batches 2-5 of epoch 1 again, from the skip ledger, to
    end bitwise as the whole run."""
    runs = values(run_ranks(_rollback_job, 2, str(tmp_path), timeout=140))
    for rank, run in enumerate(runs):
        whole, again = run["whole"], run["again"]
        rollbacks = [e for e in whole["events"] if e["kind"] == "rollback"]
        assert [(e["step"], e["restored_step"]) for e in rollbacks] == [(13, 10)]
        assert rollbacks[0]["batches_skipped"] == [2, 3, 4, 5]
        resumed = [e for e in again["events"] if e["kind"] == "resume"][-1]
        assert (resumed["from_step"], resumed["epoch"], resumed["position"]) == (6, 0, 6)
        assert resumed["loader_state"] is True
        fed = [b for b in again["seen"] if b[0] == 1 and set(b[1:]) & set(run["poison"])]
        assert not fed, f"rank {rank}: the poisoned batch was fed again after the resume"
        # the whole run's batches from step 6, without the four it rolled back over
        expected = whole["seen"][6:10] + whole["seen"][14:]
        assert again["seen"] == expected, f"rank {rank}"
        assert whole["step"] == again["step"] == EPOCHS * BATCHES - 4
        assert again["same"] and whole["params"].equal(again["params"]), f"rank {rank}"
