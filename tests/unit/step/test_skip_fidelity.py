"""A skipped step leaves no trace: buffers its forward wrote are put back, so the model is
bit-identical to a run whose loader never yielded that batch; a bundle starts from the
step's real start and holds the step's own micro-batches, however far the loop fetched."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_buffer_models import (
    BufferNet,
    ZeroStartScale,
    assert_identical,
    batches,
    loss_fn,
    prefetching_loop,
    state_of,
    train_bare,
    train_guarded,
)

import trainguard as tg
from trainguard.replay import ReplaySpec, replay

BAD = 3
STEPS = 8


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _adam_fused(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def _reference(make_opt: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = BufferNet()
    opt = make_opt(model)
    data = batches(STEPS, bad=BAD)
    train_bare(model, opt, [b for i, b in enumerate(data) if i != BAD])
    return state_of(model)


@pytest.mark.parametrize(("make_opt", "fused"), [(_sgd, False), (_adam_fused, True)])
def test_skip_leaves_the_model_as_if_the_batch_never_came(
    tmp_path: Path, make_opt: Any, fused: bool
) -> None:
    torch.manual_seed(0)
    model = BufferNet()
    opt = make_opt(model)
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, capture=False) as guard:
        train_guarded(guard, model, opt, batches(STEPS, bad=BAD), fused)
    assert guard.state.total_nonfinite == 1  # one bad sample costs one step, not the run
    assert_identical(state_of(model), _reference(make_opt))
    skips = _events(tmp_path, "skip")
    assert [e["step"] for e in skips] == [BAD]
    if not fused:
        assert skips[0]["buffers_restored"] == 6  # bn: 3 buffers, norm: 3 buffers


def test_without_the_restore_one_nan_sample_ends_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure the restore prevents: the EMA statistic keeps every later step NaN."""
    from trainguard.step import buffers

    monkeypatch.setattr(buffers.BufferKeeper, "restore", lambda self, step: [])
    torch.manual_seed(0)
    model = BufferNet()
    opt = _sgd(model)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, capture=False)
    with pytest.raises(tg.NonFiniteError):
        train_guarded(guard, model, opt, batches(12, bad=BAD), fused=False)
    guard.close()


@pytest.mark.parametrize("action", ["skip", "warn"])
def test_bundle_holds_the_buffers_from_before_the_first_forward(
    tmp_path: Path, action: str
) -> None:
    """A statistic that starts at zero makes step 0 NaN; the bundle must hold the zero (with
    "warn" the model keeps the forward's write, the bundle still starts before it)."""
    torch.manual_seed(0)
    model = ZeroStartScale()
    opt = _sgd(model)
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, on_nonfinite=action) as guard:
        train_guarded(guard, model, opt, batches(1), fused=False)
    assert guard.state.nonfinite_steps[0] == 0
    assert (float(model.scale) > 0) == (action == "warn")
    bundle = tg.load_bundle(next((tmp_path / "captures").glob("step-*")))
    assert float(bundle.model_state(0)["scale"]) == 0.0
    assert bundle.meta(0)["pre_step_buffers"] == ["scale"]
    report = replay(bundle, ReplaySpec(ZeroStartScale(), loss_fn), repeats=1, bisect=False)
    assert report.reproduced


def test_prefetching_loop_captures_the_steps_own_micro_batches(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = BufferNet()
    opt = _sgd(model)
    data = batches(12, bad=7)  # step 3's second micro-batch (accumulation 2)
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, accumulation_steps=2) as guard:
        prefetching_loop(guard, model, opt, data, k=2)
    assert list(guard.state.nonfinite_steps) == [3]
    assert not _events(tmp_path, "batch_mismatch")
    bundle = tg.load_bundle(next((tmp_path / "captures").glob("step-*")))
    saved = bundle.batches(0)
    assert len(saved) == 2
    for got, want in zip(saved, data[6:8], strict=True):
        assert torch.allclose(got[0], want[0], equal_nan=True) and torch.equal(got[1], want[1])
    report = replay(bundle, ReplaySpec(BufferNet(), loss_fn), repeats=1, bisect=False)
    assert report.reproduced


def test_a_loop_taking_other_than_k_batches_per_step_is_told(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = BufferNet()
    opt = _sgd(model)
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, accumulation_steps=1) as guard:
        prefetching_loop(guard, model, opt, batches(12), k=2)  # takes 2, told 1
    mismatch = _events(tmp_path, "batch_mismatch")
    assert len(mismatch) == 1
    assert mismatch[0]["loop_takes"] == "more" and mismatch[0]["accumulation_steps"] == 1


def test_the_forward_hook_takes_the_rng_and_autocast_of_the_steps_first_forward(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = BufferNet()
    opt = _sgd(model)
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0) as guard:
        for i, batch in enumerate(guard.watch(batches(4, bad=2))):
            torch.rand(3)  # the loop draws after the batch is handed out, before the forward
            if i == 2:
                expected = torch.get_rng_state()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model, batch)
            loss.float().backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    bundle = tg.load_bundle(next((tmp_path / "captures").glob("step-*")))
    assert torch.equal(bundle.rng(0)["torch"], expected)
    autocast = bundle.meta(0)["autocast"]
    assert autocast == {"enabled": True, "device_type": "cpu", "dtype": "bfloat16"}


def test_a_spike_skip_puts_the_buffers_back_too(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = BufferNet()
    opt = _sgd(model)
    data = batches(30)
    x, y = data[20]
    data[20] = (x * 50, y * 1e4)  # a finite loss far above the baseline: a spike
    config = tg.GuardConfig(
        run_dir=tmp_path,
        hang_timeout=0,
        capture=False,
        on_spike="skip",
        spikes=tg.SpikeConfig(warmup=10),
    )
    with tg.Guard(model, opt, config=config) as guard:
        train_guarded(guard, model, opt, data, fused=False)
    skips = _events(tmp_path, "skip")
    assert [(e["step"], e.get("reason")) for e in skips] == [(20, "spike")]
    assert skips[0]["buffers_restored"] == 6
    torch.manual_seed(0)
    reference = BufferNet()
    train_bare(reference, _sgd(reference), [b for i, b in enumerate(data) if i != 20])
    assert_identical(state_of(model), state_of(reference))


def test_sync_free_bundle_read_a_step_late_holds_the_pre_step_buffers(tmp_path: Path) -> None:
    """The sync-free step captures step 0 during step 1, after step 1's (good) forward wrote
    the buffers: the bundle must still hold step 0's start, here the initial buffers."""
    torch.manual_seed(0)
    model = BufferNet()
    opt = _adam_fused(model)
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0) as guard:
        train_guarded(guard, model, opt, batches(3, bad=0), fused=True)
    assert list(guard.state.nonfinite_steps) == [0]
    bundle = tg.load_bundle(next((tmp_path / "captures").glob("step-*")))
    saved = bundle.model_state(0)
    assert bundle.step == 0
    assert int(saved["bn.num_batches_tracked"]) == 0 and int(saved["norm.count"]) == 0
    assert torch.equal(saved["bn.running_mean"], torch.zeros(8))
    assert int(model.bn.num_batches_tracked) == 2  # steps 1 and 2 were applied


def test_a_bundle_after_a_replica_divergence_says_so(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = BufferNet()
    opt = _sgd(model)
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0) as guard:
        guard.replicas.diverged_at = 1  # as ReplicaWatch records it on every rank
        train_guarded(guard, model, opt, batches(4, bad=2), fused=False)
    bundle = tg.load_bundle(next((tmp_path / "captures").glob("step-*")))
    assert bundle.meta(0)["replica_divergence"] == 1


@pytest.mark.parametrize("first_bad", [2, 0])
def test_rerun_without_the_steps_batches_says_so_and_the_policy_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, first_bad: int
) -> None:
    """Said at the first step checked, in one line (promise 3: a loop it cannot guard is told
    at start), and again for each bad step as its ``rerun`` event; never twice for one step."""
    torch.manual_seed(0)
    model = BufferNet()
    opt = _sgd(model)
    said_at: list[int] = []
    with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, rerun=loss_fn) as guard:
        for batch in batches(4, bad=first_bad):  # not through watch(): no batches to rerun
            loss = loss_fn(model, batch)
            loss.backward()
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="trainguard"):
                if guard.check(loss):
                    opt.step()
            lines = [r.getMessage() for r in caplog.records if "cannot" in r.getMessage()]
            said_at += [guard.state.step - 1] * len(lines)
            opt.zero_grad()
    assert said_at == ([0, first_bad] if first_bad else [0]), said_at
    assert list(guard.state.nonfinite_steps) == [first_bad]
    reruns = _events(tmp_path, "rerun")
    assert [(e["step"], e["verdict"]) for e in reruns] == [(first_bad, "unavailable")]


def test_rerun_with_the_steps_batches_says_nothing_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = BufferNet()
    opt = _sgd(model)
    watching = caplog.at_level(logging.WARNING, logger="trainguard")
    with watching, tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, rerun=loss_fn) as guard:
        for batch in guard.watch(batches(3)):
            loss = loss_fn(model, batch)
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    assert not [r for r in caplog.records if "cannot" in r.getMessage()]


def test_restore_where_puts_buffers_back_in_one_launch_each() -> None:
    """The sync-free skip: the flag compared once, one in-place ``where`` per buffer (was a
    device move, a compare, a ``where`` and a copy per buffer); exact both ways."""
    from tg_ops import OpRecorder

    from trainguard.step import buffers

    model = torch.nn.Sequential(*[torch.nn.BatchNorm1d(4) for _ in range(3)]).train()
    keeper = buffers.BufferKeeper(model)
    for step, flag in enumerate((1.0, 0.0)):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        keeper.begin(step)
        model(torch.randn(8, 4) * 5 + 3)
        after = {k: v.clone() for k, v in model.state_dict().items()}
        keeper.learn(step)
        with OpRecorder() as rec:
            keeper.restore_where(torch.tensor(flag), step)
        names = [name for name, _ in rec.ops]
        assert names.count("where") == 9 and names.count("gt") == 1, names
        assert "copy_" not in names, names
        expected = start if flag else after
        for key, value in model.state_dict().items():
            assert torch.equal(value, expected[key]), (step, key)


def test_the_start_copies_the_buffers_in_one_launch_per_dtype() -> None:
    """From the third step on (two alternating stores), one ``_foreach_copy_`` per device and
    dtype: BatchNorm's float statistics and its int64 counters."""
    from tg_ops import OpRecorder

    from trainguard.step import buffers

    model = torch.nn.Sequential(*[torch.nn.BatchNorm1d(4) for _ in range(3)]).train()
    keeper = buffers.BufferKeeper(model)
    for step in range(3):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        with OpRecorder() as rec:
            keeper.begin(step)
        model(torch.randn(8, 4))
        keeper.learn(step)
        assert keeper.restore(step)  # the saved copies are the start's values
        assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())
    names = [name for name, _ in rec.ops]
    assert names == ["_foreach_copy_", "_foreach_copy_"], names


def test_a_rerun_records_its_losses_on_the_loops_basis(tmp_path: Path) -> None:
    """Accumulating 2 micro-batches and calling only ``check(loss)`` (the last one's loss),
    a transient NaN in the first micro-batch's gradients: the rerun's loss is the last
    micro-batch's too (it was the mean of both, beside the first run's last one: the event
    and the metrics log read as if the healthy loss had changed)."""
    torch.manual_seed(0)
    model = BufferNet()
    opt = _sgd(model)
    poison = {"left": 1}

    def poison_once(grad: torch.Tensor) -> torch.Tensor | None:
        if guard.state.step == 2 and poison["left"]:
            poison["left"] -= 1
            return grad * float("nan")
        return None

    model.head.weight.register_hook(poison_once)
    guard = tg.Guard(
        model, opt, run_dir=tmp_path, hang_timeout=0, rerun=loss_fn, accumulation_steps=2
    )
    with guard:
        stream = iter(guard.watch(batches(8)))
        for first in stream:
            loss_fn(model, first).backward()  # micro-batch 0 (poisoned once at step 2)
            loss = loss_fn(model, next(stream))
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    (rerun,) = _events(tmp_path, "rerun")
    assert (rerun["step"], rerun["verdict"]) == (2, "transient")
    assert rerun["rerun_losses"] == rerun["losses"]  # the same micro-batch, the same basis
