"""``trainguard run``'s loader follower: the dataset indices of the batch a ``DataLoader``
yielded last, taken from the draws of its iterator's class, wrapped process-wide, with the
loader yielding and the RNG moving as they do bare."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data import dataloader as torch_dataloader

from trainguard.attach.loader_draws import LoaderDraws


class Indexed(Dataset[tuple[Tensor, Tensor]]):
    """Each sample carries its own index, so the test knows which samples a batch holds."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return torch.full((3,), float(i)), torch.tensor(i)


class Stream(IterableDataset[Tensor]):
    def __iter__(self) -> Iterator[Tensor]:
        return iter(torch.arange(8.0).reshape(8, 1))


@pytest.fixture
def follower() -> Iterator[LoaderDraws]:
    draws = LoaderDraws()
    draws.install()
    try:
        yield draws
    finally:
        draws.remove()


def _named(follower: LoaderDraws, x: Tensor) -> list[int] | None:
    found = follower.at_forward((x,), {})
    return None if found is None else found()


def _two_epochs(
    workers: int, shuffle: bool, follower: LoaderDraws | None
) -> tuple[list[list[int]], Tensor]:
    """The batches' indices of two epochs (``follower``: each checked against what it names
    at the forward) and the RNG state after them."""
    persistent = workers > 0  # the same iterator, reset for the second epoch
    loader = DataLoader(
        Indexed(), batch_size=6, shuffle=shuffle, num_workers=workers, persistent_workers=persistent
    )
    torch.manual_seed(0)
    seen = []
    for _ in range(2):
        for x, index in loader:  # the forward sees the batch the loader yielded last
            if follower is not None:
                assert _named(follower, x) == index.tolist()
            seen.append(index.tolist())
    return seen, torch.get_rng_state()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_each_batch_is_named_by_the_indices_its_sampler_drew(
    follower: LoaderDraws, workers: int, shuffle: bool
) -> None:
    seen, rng = _two_epochs(workers, shuffle, follower)
    follower.remove()
    bare, bare_rng = _two_epochs(workers, shuffle, None)
    assert seen == bare and len(seen) == 14  # the same batches, the RNG where it goes bare
    assert torch.equal(rng, bare_rng)


def test_a_batch_the_loop_split_or_changed_is_not_named(follower: LoaderDraws) -> None:
    loader = DataLoader(Indexed(), batch_size=8)
    x, index = next(iter(loader))  # the iterator dropped at once: its draws are kept
    assert _named(follower, x) == index.tolist()
    assert _named(follower, x.clone()) == index.tolist()  # moved as it is (to a device)
    assert _named(follower, x[:4]) is None  # a micro-batch of it
    assert _named(follower, x.double() * 2) is None  # normalized
    assert follower.at_forward((), {"scale": 2.0}) is None  # no tensor to match


def test_a_loop_that_fetches_ahead_names_the_batch_the_model_ran(follower: LoaderDraws) -> None:
    """Lightning's and accelerate's loaders hold the next batch before the model sees this
    one: the batch is named by what it holds, not by which yield came last."""
    loader = iter(DataLoader(Indexed(), batch_size=5, shuffle=True))
    current = next(loader)
    for ahead in loader:
        assert _named(follower, current[0]) == current[1].tolist()
        current = ahead
    assert _named(follower, current[0]) == current[1].tolist()


def test_a_nan_sample_is_named_too(follower: LoaderDraws) -> None:
    class Poisoned(Indexed):
        def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
            x, index = super().__getitem__(i)
            return (x * float("nan") if i == 17 else x), index

    loader = DataLoader(Poisoned(), batch_size=4, sampler=list(range(16, 20)))
    x, index = next(iter(loader))
    assert _named(follower, x) == [16, 17, 18, 19] == index.tolist()


def test_an_iterable_datasets_batch_is_not_named(follower: LoaderDraws) -> None:
    next(iter(DataLoader(Indexed(), batch_size=4)))  # a map-style batch yielded before it
    batch = next(iter(DataLoader(Stream(), batch_size=4)))
    assert _named(follower, batch) is None


def test_remove_puts_torchs_methods_back() -> None:
    cls = torch_dataloader._BaseDataLoaderIter
    before = (cls._next_index, cls.__next__)
    follower = LoaderDraws()
    follower.install()
    assert (cls._next_index, cls.__next__) != before
    follower.remove()
    assert (cls._next_index, cls.__next__) == before
    assert follower.at_forward((torch.zeros(8, 1),), {}) is None


def test_a_tensor_subclass_or_one_take_refuses_is_not_named(follower: LoaderDraws) -> None:
    """A DTensor's ops may be collectives (never on one rank alone): subclasses are not
    probed; a sparse batch torch.take refuses stays unknown, without an error."""

    class Sub(Tensor):
        pass

    x, _ = next(iter(DataLoader(Indexed(), batch_size=4)))
    assert follower.at_forward((x.as_subclass(Sub),), {}) is None
    assert _named(follower, x.to_sparse()) is None
    assert _named(follower, x) is not None


def test_a_batch_sampler_that_refills_one_list_is_named_by_each_draw(
    follower: LoaderDraws,
) -> None:
    """A batch sampler may hand the same list back refilled (the loader reads it at once):
    each draw is kept as it was drawn, not by reference."""

    class Refilling:
        def __iter__(self) -> Iterator[list[int]]:
            batch = [0, 0, 0, 0]
            for start in range(0, 16, 4):
                batch[:] = range(start, start + 4)
                yield batch

        def __len__(self) -> int:
            return 4

    batches = list(DataLoader(Indexed(), batch_sampler=Refilling()))
    assert [_named(follower, x) for x, _ in batches] == [index.tolist() for _, index in batches]
