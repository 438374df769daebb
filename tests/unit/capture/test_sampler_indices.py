"""The dataset indices of a ``DataLoader``'s batches, as its sampler drew them
(``capture/sampler_indices.py``): the diagnosis names the sample by its dataset index even
when the batch carries no index of its own, and the loader yields what it yields bare."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import trainguard as tg
from trainguard.capture.sampler_indices import SamplerIndices

SIZE = 64
BAD = 37
"""The dataset index of the sample whose features overflow the loss."""


class Rows(Dataset[tuple[Tensor, Tensor]]):
    """Sample ``i``: features that hold ``i`` (so a batch says which samples it holds), and a
    target; sample ``bad`` is huge (finite, but its squared error overflows float32)."""

    def __init__(self, bad: int = -1) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        x = torch.full((4,), float(index))
        if index == self.bad:
            x = x * 1e30
        return x, torch.zeros(1)


def _passes(loader: DataLoader[Any], follow: bool) -> tuple[list[Tensor], list[Any]]:
    """The batches of one pass (the features' first column: their dataset indices) and the
    followed draws per position."""
    iterator = iter(loader)
    found = SamplerIndices.follow(iterator) if follow else None
    batches = [x[:, 0].clone() for x, _ in iterator]
    drawn = [found.indices(p) for p in range(len(batches))] if found is not None else []
    return batches, drawn


@pytest.mark.parametrize("workers", [0, 2])
def test_the_draws_are_the_batches_samples_and_the_loader_yields_as_bare(workers: int) -> None:
    def loader() -> DataLoader[Any]:
        torch.manual_seed(3)  # RandomSampler draws its seed from the global RNG
        return DataLoader(Rows(), batch_size=5, shuffle=True, num_workers=workers)

    bare, _ = _passes(loader(), follow=False)
    after_bare = torch.rand(3)
    followed, drawn = _passes(loader(), follow=True)
    assert all(torch.equal(a, b) for a, b in zip(bare, followed, strict=True))
    assert torch.equal(torch.rand(3), after_bare)  # the global RNG moved as bare
    early = 2 * workers  # drawn by iter() before the wrap: a RandomSampler's stay unknown
    assert drawn[:early] == [None] * early
    for batch, indices in zip(followed[early:], drawn[early:], strict=True):
        assert indices == [int(v) for v in batch.tolist()]


def test_a_distributed_samplers_early_draws_are_drawn_again() -> None:
    sampler = DistributedSampler(Rows(), num_replicas=2, rank=1, shuffle=True, seed=5)
    sampler.set_epoch(4)
    loader = DataLoader(Rows(), batch_size=3, sampler=sampler, num_workers=2)
    batches, drawn = _passes(loader, follow=True)
    assert drawn == [[int(v) for v in batch.tolist()] for batch in batches]
    sampler.set_epoch(5)  # another epoch's early draws are not this pass's: unknown
    iterator = iter(loader)
    found = SamplerIndices.follow(iterator)
    assert found is not None
    sampler.set_epoch(6)
    assert found.indices(0) is None
    del iterator


def test_other_iterables_are_not_followed() -> None:
    assert SamplerIndices.follow(iter([1, 2, 3])) is None
    ordered = DataLoader(Rows(), batch_size=4, num_workers=2, in_order=False)
    assert SamplerIndices.follow(iter(ordered)) is None  # batches may come out of order


def _factory() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return nn.Linear(4, 1), lambda model, batch: F.mse_loss(model(batch[0]), batch[1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_the_diagnosis_names_the_bad_sample_by_its_dataset_index(
    tmp_path: Path, workers: int
) -> None:
    """A plain loop over ``DataLoader(sampler=DistributedSampler(...))``, batches of bare
    tensors: the bundle's ``meta.json`` holds the sampler's indices of the bad step's
    micro-batch, and the replay names the culprit by dataset index 37."""
    model, loss_fn = _factory()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = tg.Guard(model, opt, run_dir=tmp_path / "run", hang_timeout=0)
    sampler = DistributedSampler(Rows(BAD), num_replicas=1, rank=0, shuffle=True, seed=1)
    loader = DataLoader(Rows(BAD), batch_size=8, sampler=sampler, num_workers=workers)
    for x, y in guard.watch(loader):
        loss = loss_fn(model, (x, y))
        loss.backward()
        if guard.check(loss):
            opt.step()
        opt.zero_grad()
    guard.close()
    (bundle,) = sorted((tmp_path / "run" / "captures").glob("step-*"))
    meta = json.loads((bundle / "rank-0" / "meta.json").read_text())
    (indices,) = meta["dataset_indices"]
    order = list(sampler)  # the epoch's draw: the batch at position n holds order[8n:8n+8]
    start = order.index(indices[0])
    assert BAD in indices and start % 8 == 0 and indices == order[start : start + 8]
    report = tg.replay(bundle, _factory).to_dict()
    assert [c["index"] for c in report["culprit_samples"]] == [BAD]


class NanRow(Rows):
    """Sample ``bad``'s features hold a NaN (an input the guard's input check finds)."""

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        x, y = super().__getitem__(index)
        if index == self.bad:
            x = x.clone()
            x[1] = float("nan")
        return x, y


@pytest.mark.parametrize("sync_free", [False, True])
def test_a_non_finite_input_is_named_by_its_dataset_index(tmp_path: Path, sync_free: bool) -> None:
    """The ``bad_input`` event and its line name the sample by the index the sampler drew,
    also from the sync-free step, which reads the step a step late."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=sync_free)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, capture=False)
    sampler = DistributedSampler(NanRow(21), num_replicas=1, rank=0, shuffle=True, seed=2)
    for x, y in guard.watch(DataLoader(NanRow(21), batch_size=8, sampler=sampler)):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if sync_free:
            guard.step(loss)
        elif guard.check(loss):
            opt.step()
        if not sync_free:
            opt.zero_grad()
    guard.close()
    (event,) = [e for e in tg.read_events(tmp_path, 0) if e["kind"] == "bad_input"]
    (tensor,) = event["tensors"]
    order = list(sampler)
    step = order.index(21) // 8
    assert event["step"] == step and tensor["dataset_indices"] == [21]
    assert order[step * 8 + tensor["positions"][0]] == 21
