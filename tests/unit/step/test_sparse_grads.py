"""Sparse gradients (``nn.Embedding(sparse=True)``) in one process: the guard checks, clips
and names them as it does dense ones, and never crashes the training it guards.

Every test here fails with ``NotImplementedError: ... 'aten::linalg_vector_norm' ...
'SparseCPU'`` when the gradient pass has no sparse handling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tg_models import TinyNet
from tg_sparse import (
    SparseNet,
    dense_grads,
    flat_params,
    loss_fn,
    make_batches,
    optimizer,
    torch_clipped,
)
from torch import Tensor

import trainguard as tg
from trainguard.step.detect import clip_, clip_on_device_, grad_stats, named_parameters
from trainguard.testing import Fault, FaultPlan

CPU = torch.device("cpu")
KINDS = ["sgd", "sparse_adam"]


def _model(kind: str) -> tuple[SparseNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = SparseNet()
    return model, optimizer(model, kind)


def _guarded(tmp_path: Path, kind: str, **kwargs: Any) -> tuple[tg.Guard, SparseNet]:
    model, opt = _model(kind)
    return tg.Guard(model, opt, run_dir=tmp_path, **kwargs), model


def _train(guard: tg.Guard, model: SparseNet, plan: FaultPlan, n: int) -> list[bool]:
    """The documented loop, with an unconditional optimizer step (a skip must hold)."""
    results = []
    for batch in guard.watch(make_batches(n, seed=1)):
        step = guard.state.step
        loss = plan.loss(loss_fn(model, batch), step)
        loss.backward()
        plan.grads(model, step)
        before = flat_params(model).clone()
        results.append(guard.check(loss))
        guard.optimizer.step()
        guard.optimizer.zero_grad()
        assert torch.equal(before, flat_params(model)) != results[-1], f"step {step}"
    return results


def _unguarded(kind: str, n: int, skip: tuple[int, ...] = ()) -> Tensor:
    """The same run without a guard; the steps in ``skip`` never happen."""
    model, opt = _model(kind)
    for step, batch in enumerate(make_batches(n, seed=1)):
        if step in skip:
            continue
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return flat_params(model)


def _backward(model: torch.nn.Module, seed: int = 3) -> None:
    loss_fn(model, make_batches(1, seed=seed)[0]).backward()


def _nonfinite(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in tg.read_events(run_dir, rank=0) if e["kind"] == "nonfinite"]


# -- the gradient pass ------------------------------------------------------------------------


def test_sparse_norm_is_the_dense_gradients_norm() -> None:
    torch.manual_seed(0)
    model = SparseNet()
    _backward(model)
    grad = model.emb.weight.grad
    assert grad is not None and grad.is_sparse and not grad.is_coalesced()
    dense = dense_grads(model)
    assert not torch.isclose(grad._values().norm(), dense["emb.weight"].norm())  # duplicates

    for mixed in (False, True):  # found by the fused pass refusing it, or told up front
        stats = grad_stats(named_parameters(model), CPU, mixed=mixed)
        assert stats.mixed and stats.norms is not None
        norms = dict(zip(stats.names, stats.norms.tolist(), strict=True))
        assert set(norms) == set(dense)
        for name, want in dense.items():
            assert norms[name] == pytest.approx(float(want.norm()), rel=1e-6)
        total = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in dense.values()]))
        assert float(stats.norm) == pytest.approx(float(total), rel=1e-6)
        assert stats.names[-1] == "emb.weight" and stats.grads[-1] is grad  # sparse come last
        assert stats.bad_names() == []


def test_dense_models_stay_on_the_fused_pass() -> None:
    torch.manual_seed(0)
    model = TinyNet()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    fused = grad_stats(named_parameters(model), CPU)
    assert not fused.mixed
    told = grad_stats(named_parameters(model), CPU, mixed=True)  # a caller's stale "mixed"
    assert told.mixed and told.names == fused.names
    assert told.norms is not None and fused.norms is not None
    assert torch.equal(told.norms, fused.norms) and torch.equal(told.norm, fused.norm)


def test_clip_on_device_scales_sparse_gradients_as_clip_does() -> None:
    grads = []
    for _ in range(2):
        torch.manual_seed(0)
        model = SparseNet()
        _backward(model)
        grads.append(grad_stats(named_parameters(model), CPU).grads)
    reference = [g.to_dense().clone() for g in grads[0]]
    coef = clip_(grads[0], 4.0, 1.0)
    clip_on_device_(grads[1], torch.tensor(4.0, dtype=torch.float64), 1.0)
    assert coef < 1.0
    for exact, on_device, before in zip(grads[0], grads[1], reference, strict=True):
        assert exact.layout == before.layout or exact.is_sparse  # scaled in place, still sparse
        assert torch.allclose(exact.to_dense(), before * coef, rtol=1e-6, atol=0)
        assert torch.allclose(on_device.to_dense(), exact.to_dense(), rtol=1e-6, atol=0)


# -- the guard --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_nan_in_the_embedding_gradient_is_skipped_and_named(tmp_path: Path, kind: str) -> None:
    guard, model = _guarded(tmp_path, kind)
    plan = FaultPlan([Fault(step=2, where="grad", param="emb.weight")])
    assert _train(guard, model, plan, 5) == [True, True, False, True, True]
    guard.close()
    assert torch.isfinite(flat_params(model)).all()
    assert torch.equal(flat_params(model), _unguarded(kind, 5, skip=(2,)))
    (event,) = _nonfinite(tmp_path)
    assert (event["step"], event["where"], event["params"]) == (2, "grad", ["emb.weight"])


def test_nan_loss_from_a_bad_sample_is_skipped(tmp_path: Path) -> None:
    guard, model = _guarded(tmp_path, "sgd")
    assert _train(guard, model, FaultPlan([Fault(step=1)]), 4) == [True, False, True, True]
    guard.close()
    assert torch.equal(flat_params(model), _unguarded("sgd", 4, skip=(1,)))
    (event,) = _nonfinite(tmp_path)
    assert event["where"] == "loss" and "emb.weight" in event["params"]  # backward spread it


@pytest.mark.parametrize("kind", KINDS)
def test_healthy_run_is_bit_identical_to_an_unguarded_one(tmp_path: Path, kind: str) -> None:
    guard, model = _guarded(tmp_path, kind)
    assert all(_train(guard, model, FaultPlan([]), 6))
    guard.close()
    assert torch.equal(flat_params(model), _unguarded(kind, 6))


@pytest.mark.parametrize("kind", KINDS)
def test_clipping_matches_torch_clip_grad_norm(tmp_path: Path, kind: str) -> None:
    max_norm = 0.02  # below every step's norm
    guard, model = _guarded(tmp_path, kind, grad_clip=max_norm)
    clipped = 0
    for batch in guard.watch(make_batches(4, seed=1)):
        loss = loss_fn(model, batch)
        loss.backward()
        before = dense_grads(model)
        want = torch_clipped(before, max_norm)
        assert guard.check(loss)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads["emb.weight"].is_sparse  # clipped in place
        for name, grad in grads.items():
            assert torch.allclose(grad.to_dense(), want[name], rtol=1e-6, atol=1e-9), name
        clipped += not torch.allclose(want["emb.weight"], before["emb.weight"])
        guard.optimizer.step()
        guard.optimizer.zero_grad()
    guard.close()
    assert clipped == 4  # every step was above max_norm: the comparison saw real clipping


def test_sync_free_step_fails_as_the_fused_optimizer_does(tmp_path: Path) -> None:
    """Fused optimizers take no sparse gradients; the guard's device-side pass (norms, clip,
    found_inf) gets through, so the error the user sees is torch's own."""
    torch.manual_seed(0)
    model = SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    guard = tg.Guard(model, opt, run_dir=tmp_path, grad_clip=0.05)
    batch = make_batches(1, seed=1)[0]
    loss = loss_fn(model, batch)
    loss.backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        guard.step(loss)
    guard.close()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_input_is_checked(tmp_path: Path, layout: str) -> None:
    guard, model = _guarded(tmp_path, "sgd")
    batches = []
    for step, idx in enumerate(make_batches(3, seed=1)):
        feats = torch.zeros(idx.shape[0], 30)
        feats[:, 4] = 1.0
        if step == 1:
            feats[3, 7] = float("nan")
        batches.append((idx, feats.to_sparse() if layout == "coo" else feats.to_sparse_csr()))
    results = []
    for idx, _feats in guard.watch(batches):
        loss = loss_fn(model, idx)  # the features only ride along: the input check sees them
        loss.backward()
        results.append(guard.check(loss))
        guard.optimizer.step()
        guard.optimizer.zero_grad()
    guard.close()
    assert results == [True, False, True]
    (event,) = [e for e in tg.read_events(tmp_path, rank=0) if e["kind"] == "bad_input"]
    assert [(t["path"], t["positions"]) for t in event["tensors"]] == [("[1]", [3])]


def test_float64_gradients_are_checked_and_clipped(tmp_path: Path) -> None:
    """float64 gradients: the fused float32 pass refuses them too (``dtype=`` cannot narrow)."""
    torch.manual_seed(0)
    model = TinyNet().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, run_dir=tmp_path, grad_clip=0.05)
    plan = FaultPlan([Fault(step=1, where="grad", param="head.weight")])
    results = []
    for step in range(3):
        loss = model(torch.randn(4, 8, dtype=torch.float64)).pow(2).mean()
        loss.backward()
        plan.grads(model, step)
        want = torch_clipped(dense_grads(model), 0.05)
        results.append(guard.check(loss))
        if results[-1]:
            for name, p in model.named_parameters():
                assert p.grad is not None
                assert torch.allclose(p.grad, want[name], rtol=1e-6, atol=1e-12), name
        opt.step()
        opt.zero_grad()
    guard.close()
    assert results == [True, False, True]
    assert [e["params"] for e in _nonfinite(tmp_path)] == [["head.weight"]]


def test_a_sparse_models_bundle_replays(tmp_path: Path) -> None:
    """Replay reads sparse gradients by their stored values (it crashed on isfinite/pow)."""
    from tg_sparse import SparseNet, loss_fn, make_batches

    from trainguard.replay import ReplaySpec, replay

    torch.manual_seed(0)
    model = SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = make_batches(3, seed=1)
    data[1][2, 3] = 7
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0) as guard:
        for i, batch in enumerate(guard.watch(data)):
            if i == 1:
                with torch.no_grad():
                    model.emb.weight[7, 0] = float("inf")  # the row batch 1 reads
            loss = loss_fn(model, batch)
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    bundle = next((tmp_path / "captures").glob("step-*"))
    report = replay(bundle, ReplaySpec(SparseNet(), loss_fn), repeats=1, bisect=False)
    assert report.reproduced
    assert report.verdict == "nonfinite_rows"  # row 7 of the table, which sample 2 alone reads
    assert report.details["weights"]["rows"]["rows"] == [7]
