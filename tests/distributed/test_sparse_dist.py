"""Sparse gradients under DDP on 2 gloo ranks (DDP all-reduces the embedding's sparse
gradient): the same skip on every rank, the sparse parameter named, torch's clipping, and
a healthy run bit-identical to an unguarded one. One spawned job runs every scenario.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tg_dist import run_ranks, values
from tg_sparse import (
    SparseNet,
    dense_grads,
    flat_params,
    loss_fn,
    make_batches,
    optimizer,
    torch_clipped,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from trainguard.testing import Fault, FaultPlan

STEPS = 5
KINDS = ("sgd", "sparse_adam")
FAULTS = [
    Fault(step=1, rank=1),  # a bad sample on rank 1: NaN loss, spread by the all-reduce
    Fault(step=3, rank=0, where="grad", param="emb.weight"),  # rank 0's sparse gradient only
]
BAD_STEPS = (1, 3)
MAX_NORM = 0.01  # below every step's global gradient norm


def _ddp(kind: str) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = SparseNet()
    opt = optimizer(model, kind)
    return DDP(model), opt


def _guarded(rank: int, kind: str, run_dir: Path, plan: FaultPlan, **kw: Any) -> dict[str, Any]:
    model, opt = _ddp(kind)
    guard = tg.Guard(model, opt, run_dir=run_dir, **kw)
    results: list[bool] = []
    clip_ok: list[bool] = []
    clipping: list[bool] = []
    for batch in guard.watch(make_batches(STEPS, seed=10 + rank)):
        step = guard.state.step
        loss = plan.loss(loss_fn(model, batch), step)
        loss.backward()
        plan.grads(model, step)
        before = dense_grads(model.module)
        want = torch_clipped(before, MAX_NORM)
        clipping.append(not torch.allclose(want["emb.weight"], before["emb.weight"]))
        results.append(guard.check(loss))
        if kw.get("grad_clip") is not None:
            clip_ok.append(_clipped_as(model.module, want))
        opt.step()
        opt.zero_grad()
    guard.close()
    return {
        "results": results,
        "params": flat_params(model),
        "clip_ok": clip_ok,
        "clipping": clipping,
    }


def _clipped_as(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> bool:
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return grads["emb.weight"].is_sparse and all(
        torch.allclose(g.to_dense(), want[n], rtol=1e-6, atol=1e-9) for n, g in grads.items()
    )


def _unguarded(rank: int, kind: str, skip: tuple[int, ...] = ()) -> torch.Tensor:
    """The same DDP run without a guard; the steps in ``skip`` never happen (on any rank)."""
    model, opt = _ddp(kind)
    for step, batch in enumerate(make_batches(STEPS, seed=10 + rank)):
        if step in skip:
            continue
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return flat_params(model)


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        base = Path(root) / kind
        out[kind] = {
            "skip": _guarded(rank, kind, base / "skip", FaultPlan(FAULTS)),
            "skip_ref": _unguarded(rank, kind, skip=BAD_STEPS),
            "clip": _guarded(rank, kind, base / "clip", FaultPlan([]), grad_clip=MAX_NORM),
            "healthy": _guarded(rank, kind, base / "healthy", FaultPlan([])),
            "healthy_ref": _unguarded(rank, kind),
        }
    dist.barrier()
    return out


def _nonfinite(run_dir: Path, rank: int) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in tg.read_events(run_dir, rank) if e["kind"] == "nonfinite"}


def _assert_same_weights(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        assert torch.isfinite(run["params"]).all()
        assert torch.equal(run["params"], runs[0]["params"])


def _assert_skip(runs: list[dict[str, Any]], refs: list[torch.Tensor], run_dir: Path) -> None:
    expected = [step not in BAD_STEPS for step in range(STEPS)]
    assert [run["results"] for run in runs] == [expected] * 2  # the same decision everywhere
    _assert_same_weights(runs)
    for run, ref in zip(runs, refs, strict=True):
        assert torch.equal(run["params"], ref)  # a skipped step is a step that never happened
    for rank in range(2):
        events = _nonfinite(run_dir, rank)
        assert sorted(events) == list(BAD_STEPS)
        assert (events[1]["where"], events[1]["ranks"]) == ("loss", [1])
        assert "emb.weight" in events[1]["params"]  # the NaN went through DDP's sparse all-reduce
        assert (events[3]["where"], events[3]["grad_ranks"]) == ("grad", [0])
    assert _nonfinite(run_dir, 0)[3]["params"] == ["emb.weight"]
    assert _nonfinite(run_dir, 1)[3]["params"] == []  # rank 1's gradients were finite


@pytest.mark.timeout(120)
def test_sparse_gradients_under_ddp(tmp_path: Path) -> None:
    runs = values(run_ranks(_job, 2, str(tmp_path), timeout=110))
    for kind in KINDS:
        mine = [r[kind] for r in runs]
        _assert_skip(
            [m["skip"] for m in mine], [m["skip_ref"] for m in mine], tmp_path / kind / "skip"
        )

        clipped = [m["clip"] for m in mine]
        assert [c["results"] for c in clipped] == [[True] * STEPS] * 2
        assert [c["clip_ok"] for c in clipped] == [[True] * STEPS] * 2  # as torch clips
        assert [c["clipping"] for c in clipped] == [[True] * STEPS] * 2  # and it did clip
        _assert_same_weights(clipped)

        healthy = [m["healthy"] for m in mine]
        _assert_same_weights(healthy)
        for run, ref in zip(healthy, [m["healthy_ref"] for m in mine], strict=True):
            assert torch.equal(run["params"], ref)  # bit-identical to the unguarded run
