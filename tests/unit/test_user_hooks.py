"""A guarded model can be saved whole and deep-copied mid-training (``user_hooks.Hook``).

Loops do both by hand: ``torch.save(model, "best.pt")`` when the eval improves, an EMA or
reference model made with ``copy.deepcopy(model)``. The guard's hooks on the model must not
make the pickle fail, nor ride into the copy (where they would run a copy of the guard's
parts at every forward of the copy).

And a forward that activation checkpointing recomputes inside the backward
(``torch.utils.checkpoint``) is not a call of the loop: the guard's hooks see the step's
micro-batch once.
"""

from __future__ import annotations

import copy
import gc
import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import trainguard as tg
from trainguard.capture.bundle import load_bundle
from trainguard.health.timing import StepTimer
from trainguard.user_hooks import Hook


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def _hooks(model: nn.Module) -> list[object]:
    return [
        hook
        for module in model.modules()
        for hooks in (module._forward_pre_hooks, module._forward_hooks)
        for hook in hooks.values()
    ]


def _train(guard: tg.Guard, model: nn.Module, steps: int) -> None:
    batches = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(steps)]
    for batch in guard.watch(batches):
        loss = model(batch).square().mean()
        loss.backward()
        guard.step(loss)


def _train_forward(model: nn.Module) -> Tensor:
    model.train()
    out: Tensor = model(torch.randn(6, 4))
    return out


@pytest.fixture
def guarded(tmp_path: Path) -> tuple[tg.Guard, nn.Module]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, run_dir=tmp_path / "run", hang_timeout=0)
    _train(guard, model, 3)
    assert any(isinstance(h, Hook) and not h.inert for h in _hooks(model))
    yield guard, model
    guard.close()


def test_a_guarded_model_is_saved_whole_and_loads_without_the_guard(
    guarded: tuple[tg.Guard, nn.Module],
) -> None:
    guard, model = guarded
    buffer = io.BytesIO()
    torch.save(model, buffer)  # failed before: "Can't pickle local object ... <lambda>"
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for mine, theirs in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)
    assert _hooks(loaded) == []  # nothing of the guard's, not even an inert entry
    started = guard._parts.step_start.step
    _train_forward(loaded).sum().backward()  # a training forward of the loaded copy
    assert guard._parts.step_start.step == started  # the guard did not see it


def test_a_deep_copy_carries_nothing_of_the_guard(guarded: tuple[tg.Guard, nn.Module]) -> None:
    guard, model = guarded
    ema = copy.deepcopy(model)
    assert _hooks(ema) == [] and _hooks(copy.copy(model)) == []
    assert any(isinstance(h, Hook) and not h.inert for h in _hooks(model))  # its own stay
    started, step = guard._parts.step_start.step, guard.state.step
    _train_forward(ema).sum().backward()
    assert (guard._parts.step_start.step, guard.state.step) == (started, step)
    # the guarded model itself still starts its steps: the next forward records step 3
    _train_forward(model)
    assert guard._parts.step_start.step == guard.state.step == 3
    _train(guard, model, 2)
    assert guard.state.step == 5


def test_the_straggler_timers_hooks_stay_out_of_copies() -> None:
    model = _net()
    timer = StepTimer(model, forward_hooks=True)
    copied = copy.deepcopy(model)
    assert _hooks(copied) == []
    copied(torch.randn(6, 4))
    assert timer.take()[1] == 0.0  # the copy's forward was not timed
    model(torch.randn(6, 4))
    assert timer.take()[1] > 0.0


class _Net(nn.Module):
    """A model class of the script's own, as word-language-model's RNNModel."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.body(x))
        return out


def test_a_model_saved_whole_loads_with_the_safe_loader_and_pickles_as_unguarded(
    tmp_path: Path,
) -> None:
    """word-language-model saves ``torch.save(model, f)`` and loads it back with
    ``torch.load(f)`` (``weights_only=True``, the default) under ``safe_globals`` of its
    own classes: the guard's hooks made that fail (``Unsupported global:
    functools.partial``). The pickle is now the unguarded model's, byte for byte, whatever
    wraps the model (DDP's and the compiled wrapper's ``__getstate__`` are their own)."""
    torch.manual_seed(0)
    model = _Net()
    bare = io.BytesIO()
    torch.save(model, bare)
    user_hook = model.register_forward_pre_hook(lambda module, args: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=tmp_path / "run", hang_timeout=0) as guard:
        assert any(isinstance(h, Hook) for h in _hooks(model))
        user_hook.remove()  # the user's handle still removes the user's hook
        guarded = io.BytesIO()
        torch.save(model, guarded)
        assert guarded.getvalue() == bare.getvalue()
        torch.save(model, tmp_path / "model.pt")
        with torch.serialization.safe_globals([_Net, nn.Sequential, nn.Linear, nn.ReLU]):
            loaded = torch.load(tmp_path / "model.pt")  # weights_only=True
        assert _hooks(loaded) == []
        _train(guard, model, 2)  # the guarded model is guarded still
        assert guard.state.step == 2
    compiled = torch.compile(_Net())  # a wrapper with its own __getstate__ (not compiled here)
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    with tg.Guard(compiled, opt, run_dir=tmp_path / "compiled", hang_timeout=0):
        assert any(isinstance(h, Hook) for h in _hooks(compiled))
        assert _hooks(copy.deepcopy(compiled)) == []
        saved = io.BytesIO()
        torch.save(compiled, saved)
        saved.seek(0)
        assert _hooks(torch.load(saved, weights_only=False)) == []


def test_a_hook_calls_its_callback_and_its_copies_call_nothing() -> None:
    seen: list[int] = []
    hook = Hook(lambda value: seen.append(value))
    hook(1)
    copy.deepcopy(hook)(2)
    copy.copy(hook)(3)
    assert seen == [1]
    assert copy.deepcopy(hook).inert and not hook.inert


def test_a_guarded_model_saved_whole_loads_where_trainguard_is_not_installed(
    guarded: tuple[tg.Guard, nn.Module], tmp_path: Path
) -> None:
    """An inference server loads ``torch.save(model)`` without trainguard (protocol 2, as
    torch.save writes by default)."""
    _, model = guarded
    torch.save(model, tmp_path / "model.pt")
    script = (
        "import sys; sys.modules['trainguard'] = None\n"  # an import of it fails
        "import torch\n"
        f"model = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        "print(tuple(model(torch.randn(2, 4)).shape))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(2, 1)"


def _lr_hooks(opt: torch.optim.Optimizer) -> int:
    return len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)


def _steps(guard: tg.Guard, model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for x in guard.watch([torch.randn(8, 4, generator=gen) for _ in range(n)]):
        loss = model(x).square().mean()
        loss.backward()
        if guard.check(loss):
            opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("ending", ["closed", "dropped", "refused"])
def test_the_optimizer_keeps_no_step_hook_of_a_guard_that_ended(
    tmp_path: Path, ending: str
) -> None:
    """Recovery's LR backoff hooks the optimizer's step: a guard that closed, was dropped
    unclosed, or refused an option after recovery was built takes them off. They stayed
    once: each guard made over the same optimizer added its pair to the last one's, and a
    pickled or deep-copied optimizer carried them."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options: dict[str, Any] = {"run_dir": tmp_path, "hang_timeout": 0, "on_escalation": "rollback"}
    if ending == "refused":  # rerun= with a scaler: refused after recovery was built
        scaler = torch.amp.GradScaler("cpu")
        with pytest.raises(tg.ConfigError, match="rerun"):
            tg.Guard(model, opt, rerun=lambda m, b: m(b).sum(), scaler=scaler, **options)
    else:
        guard = tg.Guard(model, opt, **options)
        assert _lr_hooks(opt) == 2  # the backoff's pre and post step hooks, while it runs
        _steps(guard, model, opt, 3)
        if ending == "closed":
            guard.close()
        else:
            del guard
            gc.collect()
    assert _lr_hooks(opt) == 0
    with tg.Guard(model, opt, **options) as again:  # a second guard: its own pair, once
        assert _lr_hooks(opt) == 2
        _steps(again, model, opt, 2)
    assert _lr_hooks(opt) == 0


class _Checkpointed(nn.Module):
    """Blocks with dropout, checkpointed one by one (``layers``: Hugging Face's
    ``gradient_checkpointing_enable``) or not at all (the loop checkpoints the whole model)."""

    def __init__(self, layers: bool, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Dropout(0.2)) for _ in range(3)
        )
        self.head = nn.Linear(8, 1)
        self.layers, self.reentrant = layers, reentrant

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            if self.layers:
                x = x + checkpoint(block, x, use_reentrant=self.reentrant)
            else:
                x = x + block(x)
        out: Tensor = self.head(x)
        return out


def _checkpointed_run(
    how: str, run_dir: Path | None, nan_step: int = -1
) -> tuple[nn.Module, list[Tensor]]:
    model = _Checkpointed(layers=how != "whole", reentrant=how == "layers-reentrant")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0) if run_dir else None
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(6, 8, generator=gen), torch.randn(6, 1, generator=gen)) for _ in range(5)
    ]
    if nan_step >= 0:
        batches[nan_step][0][2, 3] = float("nan")
    for x, y in batches:
        # the whole model checkpointed: its forward runs again inside the backward
        out = checkpoint(model, x, use_reentrant=False) if how == "whole" else model(x)
        loss = nn.functional.mse_loss(out, y)
        loss.backward()  # type: ignore[no-untyped-call]
        if guard is None or guard.check(loss):
            opt.step()
        opt.zero_grad()
    if guard is not None:
        guard.close()
    return model, [x for x, _ in batches]


CHECKPOINTING = ["whole", "layers", "layers-reentrant"]
NO_INPUT_GRAD = "ignore:None of the inputs have requires_grad"
"""Reentrant checkpointing's warning (the blocks get no gradient: as in the bare run)."""


@pytest.mark.filterwarnings(NO_INPUT_GRAD)
@pytest.mark.parametrize("how", CHECKPOINTING)
def test_a_checkpointed_model_trains_as_bare(how: str, tmp_path: Path) -> None:
    bare, _ = _checkpointed_run(how, None)
    guarded, _ = _checkpointed_run(how, tmp_path / "run")
    for (name, a), b in zip(bare.state_dict().items(), guarded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.filterwarnings(NO_INPUT_GRAD)
@pytest.mark.parametrize("how", CHECKPOINTING)
def test_a_recomputed_forward_is_not_another_micro_batch(how: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _, inputs = _checkpointed_run(how, run_dir, nan_step=2)
    # the capture of the bad step holds the model's inputs of its one call
    (batch,) = load_bundle(run_dir / "captures" / "step-00000002").batches(0)
    torch.testing.assert_close(batch, inputs[2], rtol=0, atol=0, equal_nan=True)
