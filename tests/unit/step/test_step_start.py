"""Where a step starts (step/step_start.py): the hooks it needs, and no more."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import trainguard as tg


def _hooked(model: nn.Module) -> list[str]:
    return [name or "<root>" for name, m in model.named_modules() if m._forward_pre_hooks]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))


def test_a_loop_calling_the_model_keeps_the_root_hook_only(tmp_path: Path) -> None:
    """The children's hooks (for loops that call children) go once the root started a step:
    a hook sends every call of its module down the slow path."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0) as guard:
        assert _hooked(model) == ["<root>", "0", "1", "2"]
        for batch in guard.watch([torch.randn(3, 4) for _ in range(3)]):
            rng = torch.get_rng_state()
            model(batch).pow(2).mean().backward()
            assert torch.equal(guard._parts.step_start.rng["torch"], rng)  # the forward's RNG state
            guard.step(torch.zeros(()))
            assert _hooked(model) == ["<root>"]
    assert _hooked(model) == []


def test_a_loop_calling_children_keeps_their_hooks_or_gets_them_back(tmp_path: Path) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0) as guard:
        batches = [torch.randn(3, 4) for _ in range(4)]
        for step, batch in enumerate(guard.watch(batches)):
            if step == 0:  # the root: children unhooked after this step's start
                out = model(batch)
            else:  # children only (step 1 is missed, then hooked again)
                rng = torch.get_rng_state()
                out = model[2](model[1](model[0](batch)))
            out.pow(2).mean().backward()
            if step >= 2:
                assert guard._parts.step_start.started(step)
                assert torch.equal(guard._parts.step_start.rng["torch"], rng)
            guard.step(out.detach().pow(2).mean())
            assert _hooked(model) == (["<root>"] if step == 0 else ["<root>", "0", "1", "2"])


def test_the_autocast_state_is_read_at_each_step_start(tmp_path: Path) -> None:
    """Off, then on (CPU bfloat16), then off again: each step start records what is in force
    (the "off" dict is shared between steps, never built anew)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0)
    seen = []
    for step in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step in (1, 2)):
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        seen.append(dict(guard._parts.step_start.autocast or {}))
        loss.backward()
        guard.check(loss)
        opt.zero_grad()
    guard.close()
    off = {"enabled": False, "device_type": "cpu", "dtype": None}
    on = {"enabled": True, "device_type": "cpu", "dtype": "bfloat16"}
    assert seen == [off, on, on, off]


class _AutocastInside(nn.Module):
    """Enters autocast inside its own forward, as accelerate's wrapped ``forward`` does (the
    root's pre-hook runs before it, outside autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out: torch.Tensor = self.body(x)
        return out


def test_a_step_started_by_record_batch_records_the_forward_s_autocast(tmp_path: Path) -> None:
    """Lightning and the HF Trainer hand the batch over (``record_batch``) before the
    precision context is entered: the forward's autocast is what the step ran under, whether
    the loop enters it around the model or the model inside its own forward (accelerate)."""
    on = {"enabled": True, "device_type": "cpu", "dtype": "bfloat16"}
    for inside in (False, True):
        model: nn.Module = _AutocastInside() if inside else nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with tg.Guard(model, opt, run_dir=tmp_path / str(inside), hang_timeout=0) as guard:
            for step in range(2):
                guard.record_batch(torch.randn(8, 4))
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not inside):
                    loss = model(torch.randn(8, 4)).float().pow(2).mean()
                assert guard._parts.step_start.autocast == on, (inside, step)
                loss.backward()
                guard.check(loss)
                opt.zero_grad()


def test_each_step_start_holds_that_moment_s_rng_states_drawn_or_not(tmp_path: Path) -> None:
    """Lazy snapshots (capture/rng_fingerprint.py) in a guarded loop: steps that draw nothing
    share one snapshot; a draw anywhere (the data pipeline between steps, the step itself)
    gives the next step a new one; each equals ``rng_state()`` at the step's forward."""
    import random

    import numpy as np

    from trainguard.capture.rng import rng_state

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))  # no dropout
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    draws = {3: random.random, 5: np.random.random_sample, 7: lambda: torch.rand(1)}
    noisy = {9}  # this step's own loss draws (after its start)
    snapshots = []
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0) as guard:
        for step, batch in enumerate(guard.watch([torch.randn(3, 4) for _ in range(12)])):
            if step in draws:
                draws[step]()
            expected = rng_state()
            loss = model(batch).pow(2).mean()
            if step in noisy:
                loss = loss + 0.0 * torch.rand(()).item()
            loss.backward()
            found = guard._parts.step_start.rng
            assert found is not None
            assert found["python"] == expected["python"]
            assert torch.equal(found["torch"], expected["torch"])
            assert str(found["numpy"]) == str(expected["numpy"])
            snapshots.append(guard._parts.step_start.rng_snapshot)
            guard.step(loss)
    distinct = [i for i in range(1, 12) if snapshots[i] is not snapshots[i - 1]]
    assert distinct == [3, 5, 7, 10]  # a new snapshot only after a generator moved


def test_an_evaluation_forward_is_progress_and_starts_no_step(tmp_path: Path) -> None:
    """Rank 0 evaluating alone between steps is not stuck: each forward of the guarded model
    with grad disabled or in eval mode is a beat of the watchdog's progress counter, and no
    step starts there (its RNG states and inputs stay those of the step before)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0) as guard:
        for batch in guard.watch([torch.randn(3, 4) for _ in range(2)]):
            model(batch).pow(2).mean().backward()
            guard.step(torch.zeros(()))
        started, beats = guard._parts.step_start.step, guard.progress.beats
        with torch.no_grad():
            model(torch.randn(3, 4))
        model.eval()
        model(torch.randn(3, 4)).sum().backward()  # grad on, eval mode: still an evaluation
        model.train()
        assert guard.progress.beats == beats + 2
        assert guard._parts.step_start.step == started  # no step started by either


def test_the_forward_draws_of_a_step_are_that_steps_only(tmp_path: Path) -> None:
    """``trainguard run``'s dataset indices (``loader_draws``) are kept per training forward
    of the step and read for that step only: a step whose forward the hook did not see gets
    none, not the step before's (and an evaluation forward keeps none)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0) as guard:
        start = guard._parts.step_start
        seen: list[int] = []

        def draws(args: tuple[object, ...], kwargs: dict[str, object]) -> object:
            index = len(seen)
            seen.append(index)
            return lambda: [index]

        guard.internals.follow_loader_draws(draws)  # type: ignore[arg-type]
        for _ in range(2):  # two micro-batches of step 0
            model(torch.randn(3, 4)).pow(2).mean().backward()
        found = start.forward_draws(0)
        assert found is not None and found() == [[0], [1]]
        assert start.forward_draws(1) is None  # another step: none
        guard.check(torch.zeros(()))
        with torch.no_grad():
            model(torch.randn(3, 4))  # an evaluation: no step starts, nothing kept
        assert seen == [0, 1] and start.forward_draws(1) is None
