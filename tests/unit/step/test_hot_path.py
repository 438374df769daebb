"""A good step must not sync per parameter or concatenate the gradients.

The check is observed at the aten level with a TorchDispatchMode: the number of ops it issues
must not grow with the number of parameters (a per-parameter ``.item()`` / ``isfinite`` loop
would), no op may be a host read (``_local_scalar_dense`` is what ``.item()`` dispatches to;
a world of one on the CPU, where a read is no device sync, reads at most ``ITEM_READS``),
and no ``cat``/``stack`` may take gradient-sized inputs.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tg_ops import OpRecorder
from torch import nn

import trainguard as tg
from trainguard.step.single_process import ITEM_READS


def _record_check(n_layers: int, tmp_path: Path, **kwargs: Any) -> list[tuple[str, list[int]]]:
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(n_layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, run_dir=tmp_path / str(n_layers), **kwargs)
    loss = model(torch.randn(4, 32)).sum()
    loss.backward()
    with OpRecorder() as rec:
        assert guard.check(loss)
    return rec.ops


def test_good_step_cost_does_not_grow_with_parameters(tmp_path: Path) -> None:
    large = _record_check(40, tmp_path)
    larger = _record_check(80, tmp_path)
    assert len(large) == len(larger), (large, larger)
    # a small model on the CPU reads its few values one by one (no device sync there, and
    # cheaper than a stack): bounded by ITEM_READS, never one read per parameter beyond it
    small = [name for name, _ in _record_check(2, tmp_path)]
    reads = small.count("_local_scalar_dense")
    assert 0 < reads <= ITEM_READS and "stack" not in small, small
    assert len(small) <= len(large) + ITEM_READS


def test_good_step_has_no_host_read_and_no_gradient_concat(tmp_path: Path) -> None:
    for kwargs in ({}, {"grad_clip": 1.0}):
        ops = _record_check(20, tmp_path / str(len(kwargs)), **kwargs)
        names = [name for name, _ in ops]
        assert "_local_scalar_dense" not in names  # what .item() dispatches to
        assert "nonzero" not in names and "is_nonzero" not in names
        for name, sizes in ops:
            if name in ("cat", "stack"):
                assert max(sizes) <= 1, f"{name} over gradient-sized tensors: {sizes}"
        assert names.count("_foreach_norm") == 1  # one fused pass over the gradients


def test_recorder_catches_a_naive_check() -> None:
    """The recorder would see the naive approaches (guards the test itself)."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    model(torch.randn(2, 8)).sum().backward()
    with OpRecorder() as rec:
        all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    names = [name for name, _ in rec.ops]
    assert names.count("is_nonzero") + names.count("_local_scalar_dense") >= 6
    assert any(name == "cat" and max(sizes) > 1 for name, sizes in rec.ops)


def _record_fused_step(n_layers: int, tmp_path: Path, guarded: bool) -> list[str]:
    """The ops of the third step (warm state) of a fused AdamW loop, guarded or bare."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(n_layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = tg.Guard(model, opt, run_dir=tmp_path / f"{n_layers}-{guarded}", hang_timeout=0)
    rec = OpRecorder()
    for step in range(3):
        loss = model(torch.randn(4, 32)).sum()
        loss.backward()
        with rec if step == 2 else contextlib.nullcontext():
            if guarded:
                guard.step(loss)
            else:
                opt.step()
                opt.zero_grad()
    return [name for name, _ in rec.ops]


def test_sync_free_step_adds_a_few_ops_whatever_the_model(tmp_path: Path) -> None:
    """Each op costs host time on a launch-bound GPU loop: the guard's share stays small."""
    for n_layers in (2, 30):
        guarded = _record_fused_step(n_layers, tmp_path, guarded=True)
        bare = _record_fused_step(n_layers, tmp_path, guarded=False)
        extra = Counter(guarded) - Counter(bare)
        assert sum(extra.values()) <= 10, extra
        assert extra["_foreach_norm"] == 1 and "_local_scalar_dense" not in guarded
