"""A ``torch.compile``d model stays compiled under the guard, and its steps are guarded in full.

The guard's forward hooks used to be traced by dynamo on the module inside
``torch.compile(model)``'s wrapper (and on a module compiled in place, ``module.compile()``,
where every hook is inside the compiled call): dynamo guarded on the step counter the hook
compares, so the model recompiled at every step and, after ``recompile_limit`` (8) steps, ran
eager for the rest of the run, torch.compile silently lost. Now a hook does nothing inside a
trace, the hooks of a module compiled in place run around its compiled call
(``user_hooks.EagerCalls``), and the step still starts at its first forward: a skipped step's
buffers are put back and its capture replays.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tg_buffer_models import BufferNet, batches, loss_fn, state_of
from torch import nn
from torch._dynamo.utils import counters

import trainguard as tg
from trainguard.user_hooks import EagerCalls, Hook, add_forward_hooks, eager_module, prepare_eager

STEPS = 12
BAD_STEP = 9  # past the recompile limit (8) the old hooks forced

Compile = Callable[[nn.Module], nn.Module]


def _wrapped(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="eager")  # type: ignore[return-value]


def _not_compiled(model: nn.Module) -> nn.Module:
    return model


def _in_place(model: nn.Module) -> nn.Module:
    model.compile(backend="eager")
    return model


HOW: dict[str, Compile] = {"torch.compile(model)": _wrapped, "model.compile()": _in_place}


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def _train(
    compile_: Compile, data: list, run_dir: Path | None, compile_loss: bool = False
) -> tuple[dict, int, tg.Guard | None]:
    """``(state, graphs compiled, guard)`` of a compiled BufferNet trained on ``data``;
    ``compile_loss``: the model is called inside ``torch.compile(loss_fn)``."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = BufferNet()
    net = compile_(model)
    step_loss = torch.compile(loss_fn, backend="eager") if compile_loss else loss_fn
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    guard = tg.Guard(net, opt, run_dir=run_dir) if run_dir is not None else None
    for batch in guard.watch(data) if guard is not None else data:
        loss = step_loss(net, batch)
        loss.backward()
        if guard is None or guard.check(loss):
            opt.step()
        opt.zero_grad()
    if guard is not None:
        guard.close()
    return state_of(model), int(counters["stats"]["unique_graphs"]), guard


@pytest.mark.parametrize("how", list(HOW))
def test_a_compiled_model_is_not_recompiled_and_its_bad_step_leaves_no_trace(
    how: str, tmp_path: Path
) -> None:
    compile_ = HOW[how]
    clean = [b for i, b in enumerate(batches(STEPS, bad=BAD_STEP)) if i != BAD_STEP]
    reference, bare_graphs, _ = _train(compile_, clean, None)
    guarded, graphs, guard = _train(compile_, batches(STEPS, bad=BAD_STEP), tmp_path)
    assert guard is not None and list(guard.state.nonfinite_steps) == [BAD_STEP]
    assert bare_graphs >= 1 and graphs == bare_graphs  # compiled once, as without the guard
    for name, value in reference.items():  # BatchNorm and EmaNorm statistics put back
        assert torch.equal(guarded[name], value), name
    bundle = tg.load_bundle(tmp_path / "captures" / f"step-{BAD_STEP:08d}")
    meta = bundle.meta(0)
    assert meta["batch_stored"] and meta["rng_stored"]
    assert meta["forward_inputs"] is not None  # the step started at its first forward
    report = tg.replay(bundle, lambda: (BufferNet(), loss_fn))
    assert report.reproduced and report.verdict == "bad_input"


def test_hooks_around_a_model_compiled_in_place_run_eagerly_and_come_off() -> None:
    model = BufferNet()
    plain_call = model._compiled_call_impl
    assert plain_call is None and eager_module(model) is model
    model.compile(backend="eager")
    compiled_call = model._compiled_call_impl
    seen: list[tuple[str, bool]] = []
    handle = add_forward_hooks(
        model,
        pre=lambda m, args, kwargs: seen.append(("pre", torch.compiler.is_compiling())),
        post=lambda m, args, out: seen.append(("post", torch.compiler.is_compiling())),
    )
    assert isinstance(model._compiled_call_impl, EagerCalls)
    model(torch.randn(8, 4))
    model(torch.randn(8, 4))
    assert seen == [("pre", False), ("post", False)] * 2  # once per call, never traced
    assert pickle.loads(pickle.dumps(model))._compiled_call_impl is None
    assert copy.deepcopy(model)._compiled_call_impl is None
    handle.remove()
    assert model._compiled_call_impl is compiled_call


def test_a_traced_hook_runs_eagerly_or_not_at_all() -> None:
    """Traced by dynamo, a hook inside a compile wrapper does nothing (the wrapper's own hook
    ran); any other runs its callback eagerly (a graph break), never as part of the graph."""
    prepare_eager()
    calls: list[tuple[str, bool]] = []
    inside = Hook(lambda: calls.append(("inside", torch.compiler.is_compiling())), True)
    other = Hook(lambda: calls.append(("other", torch.compiler.is_compiling())))

    @torch.compile(backend="eager")
    def traced(x: torch.Tensor) -> torch.Tensor:
        inside()
        other()
        return x + 1

    traced(torch.zeros(2))
    traced(torch.ones(2))
    assert calls == [("other", False)] * 2


def test_a_model_called_in_a_compiled_function_still_starts_its_steps(tmp_path: Path) -> None:
    """``torch.compile(loss_fn)`` with the model called inside: no wrapper of the model's
    runs eagerly, so its hook runs eagerly through a graph break (before: traced, a recompile
    at every step; with the hook doing nothing, the bad step's buffers stayed)."""
    clean = [b for i, b in enumerate(batches(STEPS, bad=BAD_STEP)) if i != BAD_STEP]
    reference, _, _ = _train(_not_compiled, clean, None, compile_loss=True)
    guarded, graphs, guard = _train(
        _not_compiled, batches(STEPS, bad=BAD_STEP), tmp_path, compile_loss=True
    )
    assert guard is not None and list(guard.state.nonfinite_steps) == [BAD_STEP]
    assert graphs <= 2  # before: one per step
    for name, value in reference.items():
        assert torch.equal(guarded[name], value), name


def test_eager_module_stops_at_the_compile_wrapper_inside_ddp_like_wrappers() -> None:
    model = BufferNet()
    compiled = torch.compile(model, backend="eager")
    assert eager_module(compiled) is compiled  # everything inside the wrapper is traced


def test_a_model_compiled_in_place_after_the_guard_keeps_its_steps(tmp_path: Path) -> None:
    """``model.compile()`` after ``Guard(...)``: the hooks already on it are inside the
    compiled call and run eagerly through a graph break; every step starts, skips and
    captures as for an eager model, and the model is not recompiled step after step."""
    torch.manual_seed(0)
    model = BufferNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with tg.Guard(model, opt, run_dir=tmp_path) as guard:
        model.compile(backend="eager")
        starts, graphs = [], []
        for batch in guard.watch(batches(6, bad=4)):
            loss = loss_fn(model, batch)
            starts.append(guard._parts.step_start.step == guard.state.step)
            graphs.append(int(counters["stats"]["unique_graphs"]))
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    assert starts == [True] * 6
    assert list(guard.state.nonfinite_steps) == [4]
    meta = tg.load_bundle(tmp_path / "captures" / "step-00000004").meta(0)
    assert meta["rng_stored"] and meta["forward_inputs"] is not None
    assert graphs[-1] == graphs[1] <= 2, graphs


def test_trainguard_runs_first_step_hooks_leave_a_compile_wrapper_to_dynamo() -> None:
    """``trainguard run`` records the first step's top-level calls with process-wide hooks
    (``attach/prestart.py``). Under ``torch.compile(model)`` the wrapper's call is recorded
    eagerly; inside it the hooks do nothing dynamo must trace (it cannot trace their thread
    check: a graph break and a warning at the first step, before)."""
    import warnings

    from trainguard.attach.prestart import PreStart

    model = BufferNet()
    compiled = torch.compile(model, backend="eager")
    prestart = PreStart()
    prestart.install()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss_fn(compiled, batches(1)[0]).backward()
    finally:
        prestart.remove()
    assert prestart.candidates == [compiled]
    assert len(prestart.calls[id(compiled)].batches) == 1
    assert (prestart._depth, prestart._traced) == (0, 0)
    assert not [w for w in caught if "does not know how to trace" in str(w.message)]
    assert sum(counters["graph_break"].values()) == 0
