"""Issue 15: gloo's worker thread must never release the guard's collective tensors.

A tensor created in Python and handed to a gloo collective is referenced by the work; when
gloo's worker thread drops the last reference to the work, it must take the GIL to release the
tensor's Python object (``TensorImpl::decref_pyobject``). At interpreter shutdown that aborts
the process (``terminate called without an active exception``). The tensor's Python refcount
shows it: while C++ holds the tensor, the tensor holds one reference to its Python object.

These tests use a one-rank ``ProcessGroupGloo`` made directly (no default process group, so
nothing leaks into other tests).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tg_models import TinyNet

import trainguard as tg
from trainguard.step import consensus as consensus_module
from trainguard.step.collective_work import HeldWork, retired_count
from trainguard.step.consensus import Consensus
from trainguard.step.types import LocalReport

SETTLE_S = 0.3
"""Long enough for gloo's thread to drop its reference after completing a work."""


@pytest.fixture
def gloo(tmp_path: Path) -> Any:
    from torch.distributed import FileStore, ProcessGroupGloo  # type: ignore[attr-defined]

    store = FileStore(str(tmp_path / "store"), 1)
    return ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))


def _python_refs(t: torch.Tensor) -> int:
    return sys.getrefcount(t) - 1  # less getrefcount's own argument


def _baseline() -> int:
    fresh = torch.zeros(4)
    return _python_refs(fresh)


def test_without_holding_gloos_thread_drops_the_last_reference(gloo: Any) -> None:
    """The hazard: a plain collective leaves the release of its tensor to gloo's thread."""
    buf = torch.zeros(4)
    gloo.allreduce([buf]).wait()  # the Work object is dropped at once, as a sync call does
    time.sleep(SETTLE_S)
    assert _python_refs(buf) == _baseline()  # gloo's thread let go (it took the GIL to do so)


def test_held_work_keeps_the_tensor_until_replaced_then_releases_it_here(gloo: Any) -> None:
    held = HeldWork()
    first = torch.zeros(4)
    held.wait(gloo.allreduce([first]))
    time.sleep(SETTLE_S)
    assert held.held
    assert _python_refs(first) == _baseline() + 1  # C++ still holds it: gloo's drop was not last

    second = torch.zeros(4)
    held.wait(gloo.allreduce([second]))  # replacing releases ``first`` on this thread, now
    assert _python_refs(first) == _baseline()
    time.sleep(SETTLE_S)
    assert _python_refs(second) == _baseline() + 1


def test_retire_keeps_the_last_work_until_exit(gloo: Any) -> None:
    held = HeldWork()
    buf = torch.zeros(4)
    held.wait(gloo.allreduce([buf]))
    before = retired_count()
    held.retire()
    time.sleep(SETTLE_S)
    assert not held.held and retired_count() == before + 1
    assert _python_refs(buf) == _baseline() + 1  # still not released by gloo's thread


class _FakeWork:
    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        return True


def test_consensus_all_reduce_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    works: list[_FakeWork] = []

    def fake_all_reduce(buf: torch.Tensor, op: Any = None, group: Any = None, **kw: Any) -> Any:
        assert kw.get("async_op") is True  # a sync call would drop the work at once
        works.append(_FakeWork())
        return works[-1]

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    consensus = Consensus()
    consensus.distributed, consensus.world_size, consensus.rank = True, 2, 0
    values = torch.zeros(consensus_module.DEVICE_COLUMNS, dtype=torch.float64)
    consensus.agree(LocalReport(values), sum_grad_norms=False)
    assert len(works) == 1 and works[0].waited and consensus.work.held


def test_guard_close_retires_the_consensus_work(tmp_path: Path) -> None:
    model = TinyNet()
    guard = tg.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path)
    guard._parts.consensus.work._work = _FakeWork()  # as after a distributed step
    before = retired_count()
    guard.close()
    assert retired_count() == before + 1 and not guard._parts.consensus.work.held
