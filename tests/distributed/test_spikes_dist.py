"""Spikes across real processes (gloo): the same verdict on every rank, a skipped spike
leaves the weights as they were, under DDP and FSDP2, each with check() and with the
sync-free step (the device rule folded into the fused optimizer's found_inf)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import cpu_fully_shard, run_ranks, values
from tg_models import TinyNet
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg

SPIKE_STEP = 27
STEPS = 32


def _wrap(model: TinyNet, mode: str) -> torch.nn.Module:
    if mode == "fsdp":
        cpu_fully_shard(model.encoder, model.head, model)
        return model
    return DDP(model)


def _full_params(model: torch.nn.Module) -> torch.Tensor:
    tensors = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: all-gather
        tensors.append(full.detach().reshape(-1).clone())
    return torch.cat(tensors)


def _train(rank: int, mode: str, run_dir: Path, sync_free: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _wrap(TinyNet(), mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=sync_free)
    config = tg.GuardConfig(
        run_dir=run_dir, on_spike="skip", hang_timeout=0, spikes=tg.SpikeConfig(warmup=20)
    )
    guard = tg.Guard(model, opt, config=config)
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randn(6, 8, generator=gen) for _ in range(STEPS)]
    params: dict[int, torch.Tensor] = {}
    oks = []
    for step, x in enumerate(guard.watch(data)):
        # only rank 1's batch is bad: its targets are scaled x20
        scale = 20.0 if (step == SPIKE_STEP and rank == 1) else 1.0
        loss = (model(x) - torch.ones(6, 4) * scale).pow(2).mean()
        loss.backward()
        if sync_free:
            oks.append(guard.step(loss))
        else:
            oks.append(guard.check(loss))
            opt.step()
            opt.zero_grad()
        params[step] = _full_params(model)
    guard.close()
    lines = (run_dir / "events" / f"rank-{rank}.jsonl").read_text().splitlines()
    spikes = [e for e in map(json.loads, lines) if e["kind"] == "spike"]
    decisions = {record.step: record.decision for record in guard.history.records()}
    return {
        "spike_recorded": decisions.get(SPIKE_STEP),
        "last_good_step": guard.state.last_good_step,
        "sync_free": guard._deferred,  # the device rule and found_inf, not check()
        "ok": [bool(ok) for ok in oks],
        "spikes": [(e["step"], e["metric"], e["action"]) for e in spikes],
        "unchanged": torch.equal(params[SPIKE_STEP - 1], params[SPIKE_STEP]),
        "moved_after": not torch.equal(params[SPIKE_STEP], params[SPIKE_STEP + 1]),
        "params": params[STEPS - 1],
    }


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    return {
        "ddp": _train(rank, "ddp", base / "ddp", sync_free=False),
        "fsdp": _train(rank, "fsdp", base / "fsdp", sync_free=False),
        "ddp_fused": _train(rank, "ddp", base / "ddp_fused", sync_free=True),
        "fsdp_fused": _train(rank, "fsdp", base / "fsdp_fused", sync_free=True),
    }


@pytest.mark.timeout(120)
def test_a_spike_on_one_rank_is_skipped_on_every_rank(tmp_path: Path) -> None:
    ranks = values(run_ranks(_job, 2, str(tmp_path), timeout=100))
    for name in ("ddp", "fsdp", "ddp_fused", "fsdp_fused"):
        r0, r1 = ranks[0][name], ranks[1][name]
        assert r0["sync_free"] == r1["sync_free"] == name.endswith("_fused"), name
        assert r0["ok"] == r1["ok"], name  # the same decision on both ranks
        assert [i for i, ok in enumerate(r0["ok"]) if not ok] == [SPIKE_STEP], name
        assert "loss" in {m for s, m, a in r0["spikes"] if s == SPIKE_STEP}, name
        assert {s for s, _, _ in r0["spikes"]} == {SPIKE_STEP}, name
        assert r0["spikes"] == r1["spikes"], name
        for r in (r0, r1):  # recorded as the skipped spike it was, not as a good step
            assert r["spike_recorded"] == "spike", name
            assert r["last_good_step"] == STEPS - 1, name
        for r in (r0, r1):
            assert r["unchanged"] and r["moved_after"], name  # skipped exactly, then trains
        assert torch.equal(r0["params"], r1["params"]), name  # identical replicas after
