"""``trainguard run``'s hooks in this process, around loops written without trainguard: a model
called with keyword arguments at the first step, gradients read after a skipped step, and an
evaluation through the module inside the model's wrapper (progress, not a hang), a forward
that activation checkpointing recomputes in the backward (no second micro-batch)."""

from __future__ import annotations

import gc
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tg_optimizers import Muon
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import trainguard as tg
from trainguard.attach.hooks import Attacher
from trainguard.attach.status import unguarded_reasons
from trainguard.capture.bundle import load_bundle
from trainguard.testing import poison_grad


class KeywordNet(nn.Module):
    """Called as ``model(features=..., labels=...)`` (the Hugging Face style)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 1)

    def forward(self, features: Tensor, labels: Tensor) -> Tensor:
        return (self.body(features) - labels).square().mean()


def _batches(nan_step: int) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(4, 4, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(4)
    ]
    batches[nan_step][0][1, 2] = float("nan")
    return batches


def test_keyword_arguments_of_the_first_step_are_captured(
    attached: Attacher, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = KeywordNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(nan_step=0):  # the guard exists only from the first optimizer step
        model(features=x, labels=y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    assert attached.guard is not None
    bundle = load_bundle(tmp_path / "captures" / "step-00000000")
    (batch,) = bundle.batches(0)
    assert set(batch["kwargs"]) == {"features", "labels"}
    assert torch.isnan(batch["kwargs"]["features"][1, 2])
    assert torch.equal(batch["kwargs"]["labels"], _batches(0)[0][1])


class Blocks(nn.Module):
    def __init__(self, layers: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2)) for _ in "ab")
        self.head, self.layers = nn.Linear(4, 1), layers

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=False) if self.layers else block(x))
        out: Tensor = self.head(x)
        return out


@pytest.mark.filterwarnings("error")  # ``python -W error``: a warning of ours would raise
@pytest.mark.parametrize("nan_step", [0, 2])
@pytest.mark.parametrize("layers", [False, True], ids=["whole", "layers"])
def test_a_recomputed_forward_is_not_another_micro_batch(
    attached: Attacher, tmp_path: Path, layers: bool, nan_step: int
) -> None:
    torch.manual_seed(0)
    model = Blocks(layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _batches(nan_step)
    for x, y in batches:
        # activation checkpointing runs the (whole model's, or a block's) forward again
        # inside the backward: the step's micro-batch is still its one call
        out = model(x) if layers else checkpoint(model, x, use_reentrant=False)
        nn.functional.mse_loss(out, y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    assert attached.model is model
    bundle = load_bundle(tmp_path / "captures" / f"step-{nan_step:08d}")
    (batch,) = bundle.batches(0)
    torch.testing.assert_close(batch[0], batches[nan_step][0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(batch[1], batches[nan_step][1])  # the loss's target, followed


class FailsOnce(nn.Module):
    """Its first call raises (an out-of-memory error a loop catches, then retries)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.failed = nn.Linear(4, 1), False

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.body(x)
        if not self.failed:
            self.failed = True
            raise RuntimeError("out of memory")
        return out


def test_a_first_call_that_raises_records_nothing_and_warns_nothing(
    attached: Attacher, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = FailsOnce()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _batches(nan_step=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ``python -W error``: a warning of ours would raise
        for x, y in batches:
            try:
                out = model(x)
            except RuntimeError:
                out = model(x)  # the loop retries
            nn.functional.mse_loss(out, y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()
    assert attached.model is model
    (batch,) = load_bundle(tmp_path / "captures" / "step-00000000").batches(0)
    torch.testing.assert_close(batch[0], batches[0][0], rtol=0, atol=0, equal_nan=True)


def test_a_skipped_steps_gradients_are_back_after_the_optimizer_step(attached: Attacher) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step, (x, y) in enumerate(_batches(nan_step=2)):
        (model(x) - y).square().mean().backward()  # type: ignore[no-untyped-call]
        before = model.weight.detach().clone()
        opt.step()
        grad = model.weight.grad  # the script logs its gradients after the step
        assert grad is not None
        seen.append(bool(torch.isfinite(grad).all()))
        if step == 2:
            assert torch.equal(model.weight, before)  # skipped: the weights did not move
        opt.zero_grad()
    assert seen == [True, True, False, True]
    assert attached.guard is not None and attached.guard.state.total_nonfinite == 1


def test_an_evaluation_through_the_inner_module_is_progress(
    attached: Attacher, tmp_path: Path
) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        inner = nn.Linear(4, 1)
        model = nn.parallel.DistributedDataParallel(inner)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches(nan_step=3)[:3]:
            (model(x) - y).square().mean().backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()
        guard = attached.guard
        assert guard is not None
        progress = guard.progress
        phase, beats = progress.phase, progress.beats
        inner.eval()
        with torch.no_grad():
            for _ in range(5):
                inner(torch.randn(2, 4))  # rank 0's evaluation through ``model.module``
        assert (progress.phase, progress.beats) == (phase, beats + 5)
        inner.train()
        (model(torch.randn(2, 4)) - 1).square().mean().backward()  # type: ignore[no-untyped-call]
        assert progress.phase == "step"  # the training forward, through the wrapper
    finally:
        attached.close()
        attached._remove_hooks()
        dist.destroy_process_group()
    del model, inner, opt, guard, progress
    gc.collect()  # no DDP model left alive for later tests (hang/frames.ddp_in_process)


def _refilled_buffer_loop(nan_step: int) -> None:
    """Two micro-batches a step, each copied into one preallocated input buffer (a staging
    buffer, a prefetcher); micro-batch 0 of ``nan_step`` holds a NaN."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buffer = torch.empty(4, 4)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        for micro in range(2):
            x = torch.randn(4, 4, generator=gen)
            if (step, micro) == (nan_step, 0):
                x[1, 2] = float("nan")
            buffer.copy_(x)
            (model(buffer).square().mean() / 2).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("nan_step", [0, 2])
def test_a_refilled_input_buffer_is_found_and_copied_from_then_on(
    attached: Attacher, tmp_path: Path, nan_step: int
) -> None:
    _refilled_buffer_loop(nan_step)
    events = [e for e in tg.read_events(tmp_path, 0) if e["kind"] == "batch_overwritten"]
    assert [(e["step"], e["micro_batches"]) for e in events] == [(0, [0])]  # found at once
    (batch_0, batch_1) = load_bundle(tmp_path / "captures" / f"step-{nan_step:08d}").batches(0)
    meta = load_bundle(tmp_path / "captures" / f"step-{nan_step:08d}").meta(0)
    if nan_step == 2:  # copies by then: micro-batch 0 holds its own data, the NaN
        assert torch.isnan(batch_0[1, 2]) and not torch.isnan(batch_1).any()
        assert "overwritten_micro_batches" not in meta
    else:  # the step where it was found: the bundle says what it does not hold
        assert meta["overwritten_micro_batches"] == [0]
        bundle = tmp_path / "captures" / "step-00000000"
        replayed = tg.replay(bundle, _replay_factory).to_dict()
        assert replayed["verdict"] == "not_reproduced"  # its NaN micro-batch is gone
        assert "does not hold its micro-batch(es) [0]" in replayed["summary"]
        assert "suspect" not in replayed["summary"] + replayed["advice"]  # not the device


def _replay_factory() -> tuple[nn.Module, Any]:
    return nn.Linear(4, 1), lambda model, x: model(x).square().mean() / 2


def test_record_batch_copies_a_refilled_buffer_and_not_a_batch_handed_over_twice(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=tmp_path / "twice", hang_timeout=0) as guard:
        x = torch.randn(4, 4)
        for _ in range(3):  # one batch, two forwards (R-Drop style): no refill
            for _ in range(2):
                guard.record_batch(x)
                model(x).square().mean().backward()  # type: ignore[no-untyped-call]
            guard.step(torch.zeros(()))
        assert not guard._parts.recorded.copying
    assert not [e for e in tg.read_events(tmp_path / "twice") if e["kind"] == "batch_overwritten"]
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=tmp_path / "refill", hang_timeout=0) as guard:
        _refilled_buffer_loop_with_guard(guard, model, opt)
    bundle = load_bundle(tmp_path / "refill" / "captures" / "step-00000002")
    (batch_0, _) = bundle.batches(0)
    assert torch.isnan(batch_0[1, 2])  # copies since step 0: micro-batch 0 is its own
    assert "overwritten_micro_batches" not in bundle.meta(0)


def _refilled_buffer_loop_with_guard(guard: tg.Guard, model: nn.Module, opt: Any) -> None:
    buffer = torch.empty(4, 4)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        for micro in range(2):
            x = torch.randn(4, 4, generator=gen)
            if (step, micro) == (2, 0):
                x[1, 2] = float("nan")
            buffer.copy_(x)
            guard.record_batch(buffer)
            (model(buffer).square().mean() / 2).backward()  # type: ignore[no-untyped-call]
        if guard.check(torch.zeros(())):
            opt.step()
        opt.zero_grad()


def test_the_inner_hook_of_a_compiled_model_stays_out_of_its_trace(attached: Attacher) -> None:
    """Under ``torch.compile`` the hook on the module inside the wrapper does nothing in the
    trace (traced, dynamo compiled the hook's own frame a second time), and an evaluation
    calling that module eagerly is still progress."""
    from trainguard.user_hooks import Hook

    torch.manual_seed(0)
    inner = nn.Linear(4, 1)
    model = torch.compile(inner, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(nan_step=3)[:2]:
        (model(x) - y).square().mean().backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    guard = attached.guard
    assert guard is not None
    hooks = [h for h in inner._forward_pre_hooks.values() if isinstance(h, Hook)]
    assert len(hooks) == 1 and hooks[0].inside_compiled  # the guard's step-start hook
    beats = guard.progress.beats
    inner.eval()
    with torch.no_grad():
        inner(torch.randn(2, 4))  # eager: the hook runs
    assert guard.progress.beats == beats + 1


def _train_in_a_thread(optimizer_step: bool) -> None:
    """Five steps in a thread of their own (torch.distributed.rpc's trainers run in its
    handler threads), with a torch.optim step or by hand."""

    def train() -> None:
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            model(torch.randn(8, 4)).square().mean().backward()
            if optimizer_step:
                opt.step()
            else:
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad  # type: ignore[operator]
            opt.zero_grad()

    thread = threading.Thread(target=train, name="trainer")
    thread.start()
    thread.join()


@pytest.mark.parametrize("optimizer_step", [True, False], ids=["torch.optim", "by-hand"])
def test_a_loop_in_another_thread_is_told_so(attached: Attacher, optimizer_step: bool) -> None:
    """The hooks record the main thread's calls only: a loop training in another thread was
    "cannot find the model: no module ran a training forward" at its first optimizer step,
    and without one the run ended with no word of why. Both name the thread now (at the
    first step, or at exit: the reason the run's last line gives), and nothing is guarded."""
    _train_in_a_thread(optimizer_step)
    if not optimizer_step:
        attached._never_stepped()  # what atexit runs
    assert attached.aside and attached.guard is None
    (said,), _ = unguarded_reasons(attached.options.run_dir, since=0.0)
    assert "trains in a thread other than the main one (trainer:" in said


def _two_optimizers(
    nan_step: int = -1, left_out: int = -1, flip_at: int = 99, scaled: bool = False
) -> list[Any]:
    """One model, Muon over its first layer's weight and AdamW over the rest (nanochat's
    split), stepped in that order (flipped from step ``flip_at``; through a GradScaler:
    ``scaled``); 5 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    muon = Muon([model[0].weight])
    adamw = torch.optim.AdamW([model[0].bias, *model[1].parameters()], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=scaled)
    gen = torch.Generator().manual_seed(2)
    for step in range(5):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        if step == left_out:
            continue
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if step == nan_step:  # Muon's matrix alone: the loss and AdamW's gradients finite
            poison_grad(model, "0.weight")
        for opt in (muon, adamw) if step < flip_at else (adamw, muon):
            scaler.step(opt)
        scaler.update()
        model.zero_grad()
    return [model.state_dict(), muon.state_dict()["state"], adamw.state_dict()["state"]]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))


@pytest.fixture(scope="module")
def bare_two_optimizers() -> dict[str, list[Any]]:
    """The loops without the attacher's hooks (made before them: a module fixture)."""
    return {
        "left_out": _two_optimizers(left_out=2),
        "plain": _two_optimizers(),
        "scaled": _two_optimizers(scaled=True),
    }


def test_a_second_optimizer_over_the_rest_of_the_model_is_part_of_the_step(
    bare_two_optimizers: dict[str, list[Any]], attached: Attacher, tmp_path: Path
) -> None:
    """The guard attaches to Muon (it steps first) and checks every gradient of the model:
    a NaN in Muon's matrix skips the step for AdamW too, as the bare loop leaving it out."""
    bare = bare_two_optimizers["left_out"]
    guarded = _two_optimizers(nan_step=2)
    assert attached.guard is not None and not attached.aside
    assert isinstance(attached.optimizer, Muon)
    assert _same(bare, guarded)
    events = tg.read_events(tmp_path, 0)
    assert [(e["step"], e["params"]) for e in events if e["kind"] == "nonfinite"] == [
        (2, ["0.weight"])
    ]
    assert [e["step"] for e in events if e["kind"] == "skip"] == [2]


def test_a_second_optimizer_that_steps_before_the_check_is_told_its_fix(
    bare_two_optimizers: dict[str, list[Any]], attached: Attacher
) -> None:
    """Stepped first in a step (before the guard's check at the guarded optimizer's step),
    it would update unchecked: the line says so and gives the script's fix."""
    assert _same(
        bare_two_optimizers["plain"], _two_optimizers(flip_at=3)
    )  # unguarded from the flip on: as bare
    assert attached.aside
    (said,), _ = unguarded_reasons(attached.options.run_dir, since=0.0)
    assert "a second optimizer (AdamW) updates other parameters of the model" in said
    assert "trainguard.Guard(model, muon, extra_state={'adamw': adamw})" in said


def test_under_a_grad_scaler_a_second_optimizer_is_told_its_fix(
    bare_two_optimizers: dict[str, list[Any]], attached: Attacher
) -> None:
    """The scaler's overflow skips each optimizer on its own, and at the first one's step
    the second one's gradients are still scaled: no companion, the line says so."""
    assert _same(bare_two_optimizers["scaled"], _two_optimizers(scaled=True))
    assert attached.aside
    (said,), _ = unguarded_reasons(attached.options.run_dir, since=0.0)
    assert "a second optimizer (AdamW) updates other parameters" in said and "GradScaler" in said
