"""``guard.metrics()`` (step/metrics_view.py) in one process: the numbers after a good step, a
skip, a spike, a rollback, under a GradScaler and under the sync-free step."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_models import TinyNet
from tg_recovery import make_data
from torch import nn

import trainguard as tg
from trainguard.capture import inspect_bundle
from trainguard.replay.render import inspect_text
from trainguard.step.metrics_view import KEYS, PREFIX

ALWAYS = {
    "trainguard/step",
    "trainguard/skipped_steps",
    "trainguard/nonfinite_steps",
    "trainguard/consecutive_bad",
    "trainguard/spikes",
    "trainguard/rollbacks",
    "trainguard/lr_factor",
    "trainguard/stragglers",
    "trainguard/replica_divergences",
}


def _guard(tmp_path: Path, **options: Any) -> tuple[tg.Guard, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, **options), model, opt


def _step(guard: tg.Guard, model: nn.Module, opt: Any, x: torch.Tensor, y: float = 1.0) -> bool:
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    ok = guard.check(loss)
    if ok:
        opt.step()
    opt.zero_grad()
    return ok


def test_keys_before_any_step_and_after_a_good_one(tmp_path: Path) -> None:
    guard, model, _opt = _guard(tmp_path)
    first = guard.metrics()
    assert set(first) == ALWAYS  # no loss / grad_norm before a step was decided
    assert first["trainguard/step"] == 0 and first["trainguard/lr_factor"] == 1.0
    x = torch.randn(6, 8)
    loss = (model(x) - 1.0).pow(2).mean()
    loss.backward()
    loss = loss.detach()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))  # type: ignore[union-attr]
    assert guard.check(loss)
    got = guard.metrics()
    guard.close()
    assert set(got) == ALWAYS | {"trainguard/loss", "trainguard/grad_norm"}
    assert all(k.startswith(PREFIX) and k[len(PREFIX) :] in KEYS for k in got)
    assert all(type(v) in (int, float) for v in got.values())  # host numbers, no tensors
    assert got["trainguard/step"] == 1
    assert got["trainguard/skipped_steps"] == 0 and got["trainguard/consecutive_bad"] == 0
    assert got["trainguard/loss"] == pytest.approx(loss.item())
    assert got["trainguard/grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_a_skipped_step_counts_and_the_streak_resets(tmp_path: Path) -> None:
    guard, model, opt = _guard(tmp_path, capture=False)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(6, 8, generator=gen) for _ in range(4)]
    batches[1][0, 0] = math.nan
    seen = []
    for x in guard.watch(batches):
        _step(guard, model, opt, x)
        seen.append(guard.metrics())
    guard.close()
    assert [m["trainguard/skipped_steps"] for m in seen] == [0, 1, 1, 1]
    assert [m["trainguard/nonfinite_steps"] for m in seen] == [0, 1, 1, 1]
    assert [m["trainguard/consecutive_bad"] for m in seen] == [0, 1, 0, 0]
    assert math.isnan(seen[1]["trainguard/loss"]) and seen[1]["trainguard/grad_norm"] == math.inf
    assert math.isfinite(seen[2]["trainguard/loss"])
    assert [m["trainguard/step"] for m in seen] == [1, 2, 3, 4]


@pytest.mark.parametrize(("on_spike", "skipped"), [("skip", 1), ("warn", 0)])
def test_a_spike_counts_and_is_a_skip_when_skipped(
    tmp_path: Path, on_spike: str, skipped: int
) -> None:
    config = tg.GuardConfig(
        run_dir=tmp_path,
        on_spike=on_spike,  # type: ignore[arg-type]
        hang_timeout=0,
        capture=False,
        spikes=tg.SpikeConfig(warmup=30),
    )
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = tg.Guard(model, opt, config=config)
    gen = torch.Generator().manual_seed(1)
    for step, x in enumerate(guard.watch([torch.randn(6, 8, generator=gen) for _ in range(40)])):
        _step(guard, model, opt, x, 20.0 if step == 35 else 1.0)
        if step == 34:
            before = guard.metrics()
    after = guard.metrics()
    state = guard.state_dict()
    guard.close()
    assert before["trainguard/spikes"] == 0 and after["trainguard/spikes"] == 1
    assert after["trainguard/skipped_steps"] == skipped
    assert after["trainguard/nonfinite_steps"] == 0
    # a resume from the loop's own checkpoint goes on counting: a dashboard's cumulative
    # curve does not drop
    resumed, *_ = _guard(tmp_path / "resumed", on_spike=on_spike)
    resumed.load_state_dict(state)
    again = resumed.metrics()
    resumed.close()
    assert again["trainguard/spikes"] == 1 and again["trainguard/skipped_steps"] == skipped


def test_a_rollback_counts_and_the_backoff_factor_shows(tmp_path: Path) -> None:
    """tg_recovery's poisoned job: step 5's huge update ruins the weights, steps 6-8 are
    non-finite, the third in a row escalates to a rollback to step 4; a second ruin after
    the restore backs the LR off (the ladder's second rung)."""
    config = tg.GuardConfig(
        run_dir=tmp_path,
        on_escalation="rollback",
        max_consecutive=3,
        hang_timeout=0,
        capture=False,
        recovery=tg.RecoveryConfig(
            snapshot_every=2, good_after=2, lr_backoff=0.5, lr_backoff_steps=100
        ),
    )
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = tg.Guard(model, opt, config=config)
    used: dict[int, float] = {}  # the LR each optimizer step ran with (after the guard's hook)
    opt.register_step_pre_hook(
        lambda o, args, kwargs: used.__setitem__(guard.state.step - 1, o.param_groups[0]["lr"])
    )
    seen: list[dict[str, float | int]] = []
    ruined = 0
    for x, y, scale in guard.watch(make_data(0, 24, {5: 1e37, 9: 1e37})):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if guard.check(loss):
            if scale != 1.0 and ruined < 2:
                ruined += 1
                for p in model.parameters():
                    p.grad.fill_(scale)  # type: ignore[union-attr]
            opt.step()
        opt.zero_grad(set_to_none=True)
        seen.append(guard.metrics())
    guard.close()
    # beside each good step's loss: the factor its update ran with (not the next step's)
    decided = {int(m["trainguard/step"]) - 1: m for m in seen if m["trainguard/rollbacks"] == 2}
    for step, lr in used.items():
        if step in decided and used[step] < 0.05:
            assert decided[step]["trainguard/lr_factor"] * 0.05 == pytest.approx(lr, rel=1e-9)
    # the escalating steps show the streak that escalated, not the restored state's 0
    escalated = [
        m["trainguard/consecutive_bad"]
        for m in seen
        if m["trainguard/loss"] != m["trainguard/loss"] or m["trainguard/loss"] == math.inf
    ]
    assert max(escalated) == 3
    rollbacks = [e for e in tg.read_events(tmp_path, 0) if e["kind"] == "rollback"]
    assert len(rollbacks) == 2
    assert [m["trainguard/rollbacks"] for m in seen][-1] == 2
    first = next(i for i, m in enumerate(seen) if m["trainguard/rollbacks"] == 1)
    assert seen[first]["trainguard/step"] == rollbacks[0]["restored_step"]
    assert seen[first]["trainguard/lr_factor"] == 1.0  # the first rung: no backoff
    second = next(i for i, m in enumerate(seen) if m["trainguard/rollbacks"] == 2)
    assert seen[second]["trainguard/lr_factor"] == pytest.approx(0.5)  # the second rung
    assert rollbacks[1]["lr_factor"] == pytest.approx(0.5)
    assert 0.5 < seen[-1]["trainguard/lr_factor"] < 1.0  # ramping back to 1
    assert seen[-1]["trainguard/skipped_steps"] == seen[-1]["trainguard/nonfinite_steps"] == 6
    # each step's record holds the LR its update used: the schedule's times the factor
    recorded = {r.step: r.lr for r in guard.history.records() if r.decision == "ok"}
    backed_off = [s for s in recorded if used[s] < 0.05]
    assert len(backed_off) > 10
    assert all(recorded[s] == pytest.approx(used[s], rel=1e-12) for s in recorded)


def test_a_grad_scaler_adds_its_scale_and_overflows(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    guard, model, _opt = _guard(tmp_path, scaler=scaler, capture=False)
    assert guard.metrics()["trainguard/loss_scale"] == 1024.0  # before the scale tensor exists
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(6, 8, generator=gen) for _ in range(3)]
    seen = []
    for i, x in enumerate(guard.watch(batches)):
        loss = (model(x) - 1.0).pow(2).mean()
        blowup = 1e36 if i == 1 else 1.0  # step 1's scaled gradients overflow, its loss does not
        scaler.scale(loss * blowup).backward()
        guard.step(loss)
        seen.append(guard.metrics())
    guard.close()
    assert [m["trainguard/loss_scale"] for m in seen] == [1024.0, 512.0, 512.0]
    assert [m["trainguard/overflow_steps"] for m in seen] == [0, 1, 1]
    assert seen[-1]["trainguard/skipped_steps"] == 0  # the scaler's overflow, not a bad step


def test_the_sync_free_step_reports_what_it_has_read(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, capture=False)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(6, 8, generator=gen) for _ in range(4)]
    batches[1][0, 0] = math.nan
    seen = []
    for x in guard.watch(batches):
        loss = (model(x) - 1.0).pow(2).mean()
        loss.backward()
        guard.step(loss)
        seen.append(guard.metrics())
    guard.spikes.total = 2  # as if two spikes had been seen: the saved state keeps them
    assert guard._parts.sync_free is not None and guard._parts.sync_free.pending is not None
    assert guard.state_dict()["state"]["total_spikes"] == 2  # the pending step settled
    guard.close()
    final = guard.metrics()
    assert [m["trainguard/step"] for m in seen] == [1, 2, 3, 4]
    assert "trainguard/loss" not in seen[0]  # step 0 is read during step 1
    assert [m["trainguard/skipped_steps"] for m in seen] == [0, 0, 1, 1]  # one step late
    assert math.isnan(seen[2]["trainguard/loss"])  # step 1's, read during step 2
    assert final["trainguard/skipped_steps"] == 1 and math.isfinite(final["trainguard/loss"])


def test_a_gradient_only_check_records_no_loss(tmp_path: Path) -> None:
    """``check_gradients()`` (``trainguard run``: no loss at hand) decides on the gradients and
    records no loss: not a made-up 0.0 in the history, the metrics log or ``metrics()``."""
    guard, model, _opt = _guard(tmp_path)
    (model(torch.randn(6, 8)) - 1.0).pow(2).mean().backward()
    assert guard.check_gradients()
    got = guard.metrics()
    (model(torch.randn(6, 8)) * math.nan).sum().backward()
    assert not guard.check_gradients()  # a NaN gradient is still caught
    guard.close()
    assert "trainguard/loss" not in got and "trainguard/grad_norm" in got
    assert [r.losses for r in guard.history.records()] == [[], []]
    logged = [json.loads(line) for line in (tmp_path / "metrics" / "rank-0.jsonl").open()]
    assert [line["losses"] for line in logged] == [[], []]
    assert [line["decision"] for line in logged] == ["ok", "skip"]
    (bundle,) = (tmp_path / "captures").glob("step-*")  # nor in the bad step's bundle
    meta = tg.load_bundle(bundle).meta(0)
    assert (meta["loss"], meta["loss_finite"], meta["micro_losses"]) == (None, None, [])
    assert "loss not seen" in inspect_text(inspect_bundle(bundle))
