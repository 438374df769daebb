"""CUDA paths: the sync-free step, the single sync of check(), capture and replay on a GPU.

Skipped where torch sees no GPU (CI and the development machines); run on a GPU machine with
``python -m pytest tests/unit/test_cuda.py``. ``torch.cuda.set_sync_debug_mode`` makes every
host-device synchronization that PyTorch knows of raise ("error") or warn ("warn").
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import tg_capture_models as models
import torch
from torch import Tensor, nn

import trainguard as tg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).cuda()


def _batches(n: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(16, 32, generator=gen).cuda() for _ in range(n)]


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.fixture
def sync_debug() -> Iterator[None]:
    yield
    torch.cuda.set_sync_debug_mode("default")


def _syncs_in(fn: object) -> int:
    """How many synchronizations PyTorch reports while ``fn()`` runs."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()  # type: ignore[operator]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_fused_step_issues_no_sync_and_skips_a_bad_step_on_device(
    tmp_path: Path, sync_debug: None
) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0)
    moved = []
    for i, batch in enumerate(guard.watch(_batches(8))):
        loss = model(batch).pow(2).mean()
        if i == 4:
            loss = loss * float("nan")
        loss.backward()
        guard._resolve_pending()  # the previous step's read happens here, outside the check
        before = _flat(model).clone()
        torch.cuda.set_sync_debug_mode("error")  # any sync inside step() raises
        guard.step(loss)
        torch.cuda.set_sync_debug_mode("default")
        moved.append(not torch.equal(before, _flat(model)))
    guard.close()
    assert moved == [True] * 4 + [False] + [True] * 3
    assert list(guard.state.nonfinite_steps) == [4]
    assert {float(s["step"]) for s in opt.state.values()} == {7.0}
    assert torch.isfinite(_flat(model)).all()


def test_fused_step_reading_the_previous_step_reports_no_sync(tmp_path: Path) -> None:
    """The whole call, the late read of the step before included: that read waits on a CUDA
    event recorded a step earlier, which PyTorch does not count as a synchronization."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0)
    counts = []
    for batch in guard.watch(_batches(6)):
        loss = model(batch).pow(2).mean()
        loss.backward()
        counts.append(_syncs_in(lambda loss=loss: guard.step(loss)))
    guard.close()
    assert counts == [0] * 6


def test_check_synchronizes_once_per_step(tmp_path: Path) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0)
    counts = []
    for batch in guard.watch(_batches(4)):
        loss = model(batch).pow(2).mean()
        loss.backward()
        counts.append(_syncs_in(lambda loss=loss: guard.check(loss)))
        opt.step()
        opt.zero_grad()
    guard.close()
    assert counts == [1] * 4  # the read of the agreed flags, nothing per parameter


def test_grad_clip_on_cuda_matches_clip_grad_norm(tmp_path: Path) -> None:
    bare, guarded = _mlp(), _mlp()
    bare_opt = torch.optim.SGD(bare.parameters(), lr=0.1)
    opt = torch.optim.SGD(guarded.parameters(), lr=0.1)
    guard = tg.Guard(guarded, opt, run_dir=tmp_path, hang_timeout=0, grad_clip=0.05)
    for batch in guard.watch(_batches(4)):
        bare(batch).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 0.05)
        bare_opt.step()
        bare_opt.zero_grad()
        loss = guarded(batch).pow(2).mean()
        loss.backward()
        guard.step(loss)
    guard.close()
    torch.testing.assert_close(_flat(guarded), _flat(bare), rtol=1e-5, atol=1e-6)


def test_amp_overflow_on_cuda_is_left_to_the_scaler(tmp_path: Path) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, scaler=scaler)
    results = []
    for i, batch in enumerate(guard.watch(_batches(4))):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch).float().pow(2).mean()
        scaled = scaler.scale(loss)
        if i == 1:
            scaled = scaled * 1e38  # fp32 overflow in the gradients; the loss is finite
        scaled.backward()
        ok = guard.check(loss)
        results.append(ok)
        if ok:
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    guard.close()
    assert results == [True, False, True, True]
    assert guard.state.overflow_steps == 1 and guard.state.total_nonfinite == 0
    assert scaler.get_scale() == 2.0**15


def test_capture_on_cuda_replays_on_cuda(tmp_path: Path) -> None:
    model = models.make_model("forward").cuda()
    data = [{k: v.cuda() for k, v in b.items()} for b in models.batches("forward", 3, bad_step=1)]
    models.train(model, models.ce_loss, data, tmp_path)
    (bundle,) = sorted((tmp_path / "captures").glob("step-*"))
    env = tg.load_bundle(bundle).meta(0)["env"]
    assert env["device"] == "cuda:0" and env["cuda_device"] == torch.cuda.get_device_name()
    report = tg.replay(bundle, models.forward_factory, device="cuda").to_dict()
    assert report["verdict"] == "numerical"
    assert report["reproduced"] is True
    assert "encoder.layers.0.norm" in report["summary"]
