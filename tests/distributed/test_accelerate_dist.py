"""An accelerate loop on 2 real ranks (gloo), as docs/guard.md#accelerate writes it:
``accelerator.prepare``, ``accelerator.accumulate`` (DDP's ``no_sync`` on the first
micro-batch), ``accelerator.backward``, accelerate's optimizer and scheduler. With no fault
the guarded loop trains bit for bit as the bare one; a NaN loss on one rank leaves the step
out on both, the ranks' weights identical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import run_ranks, values
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg
from trainguard.events import read_events

ACCUMULATION = 2
SAMPLES, BATCH = 128, 4  # 16 micro-batches a rank: 8 optimizer steps
NAN_MICRO = 5
"""The second micro-batch of step 2 on rank 1."""


def _loop(accelerator: Any, guarded: bool, nan: bool, run_dir: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=8)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(SAMPLES, 8, generator=gen), torch.randn(SAMPLES, 1, generator=gen)
    )
    loader = DataLoader(
        data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(2)
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    guard = None
    batches: Any = loader
    if guarded:
        guard = tg.Guard(
            model,
            optimizer,
            scheduler=scheduler,
            scaler=accelerator.scaler,
            accumulation_steps=ACCUMULATION,
            run_dir=run_dir,
            hang_timeout=0,
        )
        batches = guard.watch(loader)
    for micro, (x, y) in enumerate(batches):
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            if nan and micro == NAN_MICRO and accelerator.process_index == 1:
                loss = loss * float("nan")
            accelerator.backward(loss)
            good = True
            if guard is not None:
                guard.record_loss(loss)
                good = guard.check(loss) if accelerator.sync_gradients else True
            if good or accelerator.scaler is not None:
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    if guard is not None:
        guard.close()
    inner = accelerator.unwrap_model(model)
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in inner.parameters()]),
        "steps": float(next(iter(optimizer.optimizer.state.values()))["step"]),
    }


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    return {
        "bare": _loop(accelerator, False, False, Path(root) / "unused"),
        "guarded": _loop(accelerator, True, False, Path(root) / "clean"),
        "nan": _loop(accelerator, True, True, Path(root) / "nan"),
    }


def test_an_accelerate_loop_is_bit_identical_and_leaves_a_one_rank_nan_out_on_both(
    tmp_path: Path,
) -> None:
    pytest.importorskip("accelerate")
    out = values(run_ranks(_job, 2, str(tmp_path), timeout=120))
    for rank in (0, 1):
        assert torch.equal(out[rank]["guarded"]["params"], out[rank]["bare"]["params"])
        assert out[rank]["guarded"]["steps"] == out[rank]["bare"]["steps"] == 8
        assert out[rank]["nan"]["steps"] == 7  # step 2 left out
        assert torch.isfinite(out[rank]["nan"]["params"]).all()
        skips = [e["step"] for e in read_events(tmp_path / "nan", rank) if e["kind"] == "skip"]
        assert skips == [2]
    assert torch.equal(out[0]["nan"]["params"], out[1]["nan"]["params"])
    assert not torch.equal(out[0]["nan"]["params"], out[0]["bare"]["params"])
