"""Resume with torchdata's StatefulDataLoader in one process: the checkpoint holds the loader's
own state at the checkpoint's step boundary (not at the prefetch front), and a resumed
``watch()`` loads it, so the run sees exactly the batches an uninterrupted run sees."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import trainguard as tg
from trainguard.events import read_events
from trainguard.recovery import checkpoint as ckpt
from trainguard.recovery.loader import LoaderStates, is_stateful

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = stateful_dataloader.StatefulDataLoader

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "single process"

EPOCHS = 2
BATCHES = 8  # per epoch: 16 samples, batch size 2


class Numbered(Dataset[torch.Tensor]):
    """Sample i is a row of i's: a batch's content names its samples."""

    def __len__(self) -> int:
        return 2 * BATCHES

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((4,), float(index))


def _loader(kind: str, workers: int = 0) -> Any:
    if kind == "plain":
        return DataLoader(Numbered(), batch_size=2)
    # Shuffled with a generator of the loader's own, seeded when the loader is made: epoch 1's
    # order follows from epoch 0's draw, which a resumed run never makes. Skipping batches
    # cannot restore it; the loader's state can.
    return StatefulDataLoader(Numbered(), batch_size=2, shuffle=True, num_workers=workers)


def _run(run_dir: Path, loader: Any, crash_at: int | None = None, **options: Any) -> dict[str, Any]:
    """Train ``EPOCHS`` epochs; ``crash_at``: leave the loop before that step (a crash)."""
    try:
        return _train(run_dir, loader, crash_at, **options)
    finally:  # the left loop's iterator and its workers: now, not at a later collection
        gc.collect()  # (a worker loader collected minutes later took 10 s to shut down)


def _train(run_dir: Path, loader: Any, crash_at: int | None, **options: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    recovery = tg.RecoveryConfig(good_after=1)
    config = tg.GuardConfig(run_dir=run_dir, hang_timeout=0, recovery=recovery, **options)
    guard = tg.Guard(model, opt, config=config)
    seen: list[list[int]] = []
    with guard, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(EPOCHS):
            for x in guard.watch(loader):
                if guard.state.step == crash_at:
                    return {"seen": seen}
                seen.append([int(v) for v in x[:, 0]])
                loss = model(x / 16).pow(2).mean()
                loss.backward()
                if guard.check(loss):
                    opt.step()
                opt.zero_grad(set_to_none=True)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"seen": seen, "params": params, "step": guard.state.step}


def _resume_event(run_dir: Path) -> dict[str, Any]:
    return [e for e in read_events(run_dir, 0) if e["kind"] == "resume"][-1]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.timeout(120)
def test_stateful_loader_resumes_with_the_batches_of_an_uninterrupted_run(
    tmp_path: Path, workers: int
) -> None:
    torch.manual_seed(42)
    whole = _run(tmp_path / "whole", _loader("stateful", workers), checkpoint_every=3)
    assert whole["step"] == EPOCHS * BATCHES
    run_dir = tmp_path / "crashed"
    torch.manual_seed(42)  # the same loader (its sampler's seed comes from the global RNG)
    first = _run(run_dir, _loader("stateful", workers), crash_at=11, checkpoint_every=3)
    assert first["seen"] == whole["seen"][:11]
    torch.manual_seed(42)
    again = _run(run_dir, _loader("stateful", workers), checkpoint_every=3, resume=True)
    event = _resume_event(run_dir)
    assert (event["from_step"], event["epoch"], event["position"]) == (9, 1, 1)
    assert event["loader_state"] is True
    assert again["seen"] == whole["seen"][9:]  # steps 9.. again: nothing lost, none repeated
    assert torch.equal(again["params"], whole["params"])


def test_checkpoint_holds_the_loader_state_of_its_step_boundary(tmp_path: Path) -> None:
    """The stream has fetched the next batch(es) already; the saved state must not count them."""
    torch.manual_seed(42)
    _run(tmp_path, _loader("stateful"), checkpoint_every=3, keep_checkpoints=10)
    for path in ckpt.good_checkpoints(tmp_path):
        data = torch.load(path / "rank-0.pt", weights_only=False)["data"]
        step = ckpt.step_of(path)
        assert (data["epoch"], data["position"]) == divmod(step, BATCHES)
        assert data["loader"]["_num_yielded"] == data["position"]


def test_plain_dataloader_still_resumes_by_skipping(tmp_path: Path) -> None:
    whole = _run(tmp_path / "whole", _loader("plain"), checkpoint_every=3)
    run_dir = tmp_path / "crashed"
    _run(run_dir, _loader("plain"), crash_at=11, checkpoint_every=3)
    again = _run(run_dir, _loader("plain"), checkpoint_every=3, resume=True)
    event = _resume_event(run_dir)
    assert (event["from_step"], event["loader_state"]) == (9, False)
    assert again["seen"] == whole["seen"][9:]
    assert torch.equal(again["params"], whole["params"])


def test_ledger_positions_are_still_skipped_after_a_stateful_resume(tmp_path: Path) -> None:
    """A batch a rollback skipped after the checkpoint is not fed again after the restart."""
    from trainguard.recovery.ledger import SkipEntry, SkipLedger

    torch.manual_seed(42)
    whole = _run(tmp_path / "whole", _loader("stateful"), checkpoint_every=3)
    run_dir = tmp_path / "crashed"
    torch.manual_seed(42)
    _run(run_dir, _loader("stateful"), crash_at=11, checkpoint_every=3)
    SkipLedger(run_dir, 0).append([SkipEntry(1, 2, 10, "rollback", None)])  # epoch 1, batch 2
    torch.manual_seed(42)
    again = _run(run_dir, _loader("stateful"), checkpoint_every=3, resume=True)
    expected = whole["seen"][9:]
    del expected[1]  # step 10 of the uninterrupted run is batch 2 of epoch 1
    assert again["seen"] == expected


def test_loader_states_keep_only_what_a_checkpoint_can_still_need() -> None:
    loader = StatefulDataLoader(Numbered(), batch_size=2)
    assert is_stateful(loader) and not is_stateful(DataLoader(Numbered()))
    states = LoaderStates(loader)
    iterator = iter(loader)
    for position in range(4):
        states.before_fetch(position)
        next(iterator)
    assert len(states) == 4
    state = states.at(2)
    assert state is not None and state["_num_yielded"] == 2 and len(states) == 2
    resumed = StatefulDataLoader(Numbered(), batch_size=2)
    resumed.load_state_dict(state)
    assert [int(b[0, 0]) for b in resumed] == [4, 6, 8, 10, 12, 14]


def test_sample_indices_never_reshuffle_a_loader() -> None:
    """Re-iterating a shuffling sampler draws another order (and, for torchdata's, advances
    the loader's own generator): no indices then, and the next epoch's order is untouched."""
    from torch.utils.data import DistributedSampler

    from trainguard.recovery.ledger import sample_indices

    def shuffled() -> Any:
        torch.manual_seed(0)
        return StatefulDataLoader(Numbered(), batch_size=2, shuffle=True)

    untouched = shuffled()
    list(untouched)
    asked = shuffled()
    list(asked)
    assert sample_indices(asked, [0, 1]) == {}
    assert [b.tolist() for b in asked] == [b.tolist() for b in untouched]
    sampler = DistributedSampler(Numbered(), num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(1)
    sharded = StatefulDataLoader(Numbered(), batch_size=2, sampler=sampler)
    first = [[int(v) for v in b[:, 0]] for b in sharded]
    assert sample_indices(sharded, [0, 3]) == {0: first[0], 3: first[3]}
