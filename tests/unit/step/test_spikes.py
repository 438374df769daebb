"""The spike rule (step/spikes.py) and its policy in a single-process Guard."""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_models import TinyNet

import trainguard as tg
from trainguard.errors import SpikeError
from trainguard.step.spikes import DeviceSpikeDetector, SpikeDetector, SpikeRule

RULE = SpikeRule(z_threshold=6.0, ratio=2.0, beta=0.98, warmup=100, grace=50)


def _noisy(i: int, rng: random.Random, level: float = 1.0) -> float:
    return level * math.exp(rng.gauss(0.0, 0.05))


def _feed(det: SpikeDetector, values: list[float], lr: float | None = None) -> list[int]:
    return [i for i, v in enumerate(values) if det.observe({"loss": v}, lr)]


def test_no_decision_during_warmup() -> None:
    det = SpikeDetector(RULE)
    rng = random.Random(0)
    values = [_noisy(i, rng) for i in range(RULE.warmup)]
    values[50] = 1000.0  # a huge jump inside the warm-up is not judged
    assert _feed(det, values) == []
    assert det.observe({"loss": 1000.0})  # the same jump once warm is a spike


def test_isolated_spike_is_flagged_and_does_not_hide_the_next() -> None:
    det = SpikeDetector(RULE)
    rng = random.Random(1)
    values = [_noisy(i, rng) for i in range(400)]
    for at in (200, 210, 220):  # a window rule that took 200 in would miss 210 and 220
        values[at] *= 20.0
    assert _feed(det, values) == [200, 210, 220]
    spike = SpikeDetector(RULE)
    for v in values[:200]:
        spike.observe({"loss": v})
    [judged] = spike.observe({"loss": values[200]})
    assert judged.metric == "loss" and judged.value == values[200]
    assert judged.ratio > 10 and judged.score > RULE.z_threshold
    assert judged.baseline == pytest.approx(1.0, rel=0.1)


def test_winsorised_update_absorbs_a_level_change() -> None:
    det = SpikeDetector(RULE)
    rng = random.Random(2)
    values = [_noisy(i, rng) for i in range(200)] + [_noisy(i, rng, 5.0) for i in range(300)]
    flagged = _feed(det, values)
    assert flagged and flagged[0] == 200  # the jump itself is seen...
    assert max(flagged) < 260  # ...and the new level is learned, not flagged forever
    assert det.stats["loss"].mean == pytest.approx(math.log(5.0), abs=0.1)


def test_ratio_floor_ignores_small_moves_of_a_quiet_metric() -> None:
    det = SpikeDetector(RULE)
    values = [1.0 + 1e-6 * (i % 2) for i in range(200)] + [1.5]  # z huge, ratio 1.5 < 2
    assert _feed(det, values) == []
    assert det.observe({"loss": 2.5})  # beyond the ratio floor


def test_lr_jump_starts_a_grace_period() -> None:
    rng = random.Random(3)
    det = SpikeDetector(RULE)
    for i in range(150):
        det.observe({"grad_norm": _noisy(i, rng)}, lr=1e-3)
    assert det.observe({"grad_norm": 30.0}, lr=1e-2) == []  # the LR jumped: grace
    for i in range(RULE.grace - 1):
        det.observe({"grad_norm": _noisy(i, rng)}, lr=1e-2)
    assert det.observe({"grad_norm": 30.0}, lr=1e-2)  # grace over


def test_device_detector_matches_host() -> None:
    rng = random.Random(4)
    host = SpikeDetector(RULE)
    device = DeviceSpikeDetector(RULE, torch.device("cpu"))
    for i in range(400):
        loss, norm = _noisy(i, rng, 2.0 * math.exp(-i / 300)), _noisy(i, rng)
        if i in (150, 300):
            loss *= 20.0
        if i == 250:
            norm = float("nan")  # neither judged nor learned, on both
        flagged = {s.metric for s in host.observe({"loss": loss, "grad_norm": norm})}
        values = torch.tensor([loss, norm], dtype=torch.float64)
        verdict = device.observe(values, torch.tensor(0.0, dtype=torch.float64)).tolist()
        on_device = {
            m for m, row in zip(("loss", "grad_norm"), verdict, strict=True) if row[0] > 0.5
        }
        assert flagged == on_device, i
    for row, metric in zip(device.stats.tolist(), ("loss", "grad_norm"), strict=True):
        stats = host.stats[metric]
        assert row == pytest.approx([stats.count, stats.mean, stats.var])


def test_device_lr_grace_matches_host() -> None:
    """The device rule's LR grace (fed the agreed LR) is the host's: no judging for ``grace``
    steps after the LR jumps up, an unknown LR (0 on the device, None on the host) changes
    nothing, a drop starts no grace."""
    rule = SpikeRule(warmup=5, grace=3)
    host = SpikeDetector(rule)
    device = DeviceSpikeDetector(rule, torch.device("cpu"))
    lrs: list[float | None] = [1.0] * 10 + [5.0] + [5.0] * 2 + [None] * 3 + [0.5, 10.0] + [10.0] * 6
    spiking = {11, 12, 13, 14, 16, 18, 19, 21}
    judged = []
    for i, lr in enumerate(lrs):
        loss = 100.0 if i in spiking else 1.0 + 0.01 * (i % 3)
        flagged = {s.metric for s in host.observe({"loss": loss, "grad_norm": 1.0}, lr)}
        values = torch.tensor([loss, 1.0], dtype=torch.float64)
        agreed_lr = torch.tensor(lr or 0.0, dtype=torch.float64)
        verdict = device.observe(values, agreed_lr).tolist()
        assert ("loss" in flagged) == (verdict[0][0] > 0.5), i
        judged.append("loss" in flagged)
    assert [i for i in sorted(spiking) if judged[i]] == [13, 14, 16, 21]  # graced: 10-12, 18-20
    assert device.grace.tolist() == [10.0, 0.0]


def test_config_rejects_bad_spike_options() -> None:
    for option, value in [("on_spike", "explode"), ("spikes.z", 0.0), ("spikes.beta", 1.0)]:
        with pytest.raises(tg.ConfigError) as info:
            tg.GuardConfig.from_options({option: value})
        assert info.value.option == option


# -- the policy in a Guard -------------------------------------------------------------------


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def _run(
    tmp_path: Path,
    on_spike: str,
    spikes: set[int],
    steps: int = 130,
    nans: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = tg.GuardConfig(run_dir=tmp_path, on_spike=on_spike, spikes=tg.SpikeConfig(warmup=100))  # type: ignore[arg-type]
    guard = tg.Guard(model, opt, config=config)
    gen = torch.Generator().manual_seed(1)
    results: dict[str, Any] = {"ok": [], "params": {}, "last_good": []}
    try:
        batches = [
            (torch.randn(6, 8, generator=gen), torch.ones(6, 4) * (20.0 if i in spikes else 1.0))
            for i in range(steps)
        ]
        for step, batch in enumerate(guard.watch(batches)):
            loss = _spike_loss(model, batch) * (math.nan if step in nans else 1.0)
            loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            ok = guard.check(loss)
            results["ok"].append(ok)
            results["last_good"].append(guard.state.last_good_step)
            opt.step()
            opt.zero_grad()
            results["params"][step] = (before, [p.detach().clone() for p in model.parameters()])
    except SpikeError as exc:
        results["error"] = exc
    guard.close()
    logged = (tmp_path / "metrics" / "rank-0.jsonl").read_text().splitlines()
    results["recorded"] = {e["step"]: e["decision"] for e in map(json.loads, logged)}
    return results


def _spike_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, target = batch
    return (model(x) - target).pow(2).mean()


def test_skip_leaves_weights_alone_and_writes_the_event(tmp_path: Path) -> None:
    out = _run(tmp_path, "skip", {110})
    assert [i for i, ok in enumerate(out["ok"]) if not ok] == [110]
    before, after = out["params"][110]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    [event] = [e for e in _events(tmp_path, "spike") if e["metric"] == "loss"]
    assert event["step"] == 110 and event["action"] == "spike" and event["score"] > 6
    assert {"value", "baseline", "threshold", "ratio"} <= set(event)
    assert list((tmp_path / "captures").glob("step-00000110"))  # the first spike is captured
    assert out["recorded"][110] == "spike"  # the metrics log: a skipped spike, not "ok"
    assert out["last_good"][110] == 109 and out["last_good"][111] == 111


def test_a_skipped_spike_is_counted_inspected_and_replayed_as_a_spike(tmp_path: Path) -> None:
    """The report's decisions, the bundle's manifest and inspect, and the replay's verdict
    say spike: not a good step, not a non-finite step that did not reproduce."""
    from trainguard.capture.inspect import inspect_bundle
    from trainguard.report import summarize

    _run(tmp_path, "skip", {110})
    decisions = summarize(tmp_path).decisions
    assert decisions == {"ok": 129, "spike": 1}
    bundle = tmp_path / "captures" / "step-00000110"
    summary = inspect_bundle(bundle)
    assert (summary["trigger"], summary["decision"], summary["ranks"]) == ("spike", "spike", [])
    report = tg.replay(bundle, lambda: (TinyNet(), _spike_loss))
    assert (report.verdict, report.reproduced) == ("spike", True)
    assert "transient" not in report.summary.split(":")[0] and "suspect" not in report.summary


def test_first_spike_and_first_nonfinite_step_are_captured_independently(tmp_path: Path) -> None:
    out = _run(tmp_path, "skip", {110, 118}, nans=frozenset({114, 122}))
    assert [i for i, ok in enumerate(out["ok"]) if not ok] == [110, 114, 118, 122]
    captured = sorted(p.name for p in (tmp_path / "captures").iterdir())
    assert captured == ["step-00000110", "step-00000114"]  # each first one, once
    reasons = {e["step"]: e["reason"] for e in _events(tmp_path, "capture")}
    assert reasons == {110: "first_spike", 114: "first_bad_step"}


@pytest.mark.parametrize("on_spike", ["skip", "warn"])
def test_the_spike_line_says_what_was_done(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, on_spike: str
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        _run(tmp_path, on_spike, {110}, steps=112)
    lines = [r.getMessage() for r in caplog.records if "loss spike" in r.getMessage()]
    assert lines and lines[0].endswith(": spike" if on_spike == "skip" else ": warn")


def test_warn_lets_the_step_through(tmp_path: Path) -> None:
    out = _run(tmp_path, "warn", {110})
    assert all(out["ok"])
    assert [e["step"] for e in _events(tmp_path, "spike") if e["metric"] == "loss"] == [110]


def test_consecutive_spikes_escalate(tmp_path: Path) -> None:
    out = _run(tmp_path, "skip", {110, 111, 112})
    assert isinstance(out.get("error"), SpikeError) and out["error"].step == 112
    assert _events(tmp_path, "escalate")[0]["reason"] == "spike"


def test_rollback_escalates_at_once(tmp_path: Path) -> None:
    out = _run(tmp_path, "rollback", {110})
    assert isinstance(out.get("error"), SpikeError) and out["error"].step == 110


def test_off_judges_nothing(tmp_path: Path) -> None:
    out = _run(tmp_path, "off", {110})
    assert all(out["ok"]) and _events(tmp_path, "spike") == []


def _fused_run(tmp_path: Path, on_spike: str, spikes: set[int], sync_free: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=sync_free)
    config = tg.GuardConfig(run_dir=tmp_path, on_spike=on_spike)  # type: ignore[arg-type]
    guard = tg.Guard(model, opt, config=config)
    gen = torch.Generator().manual_seed(1)
    snapshots = []
    for step, x in enumerate(guard.watch([torch.randn(6, 8, generator=gen) for _ in range(125)])):
        target = torch.ones(6, 4) * (20.0 if step in spikes else 1.0)
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        guard.step(loss)
        snapshots.append([p.detach().clone() for p in model.parameters()])
    guard.close()
    steps = [e["step"] for e in _events(tmp_path, "spike") if e["metric"] == "loss"]
    logged = (tmp_path / "metrics" / "rank-0.jsonl").read_text().splitlines()
    recorded = {e["step"]: e["decision"] for e in map(json.loads, logged)}
    skips = _events(tmp_path, "skip")
    return {"snapshots": snapshots, "steps": steps, "skips": skips, "recorded": recorded}


def test_sync_free_step_skips_a_spike_on_the_device(tmp_path: Path) -> None:
    fused = _fused_run(tmp_path / "fused", "skip", {110}, sync_free=True)
    assert fused["steps"] == [110] and fused["recorded"][110] == "spike"
    assert [e["step"] for e in fused["skips"]] == [110]
    before, after = fused["snapshots"][109], fused["snapshots"][110]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # weights untouched
    assert not all(torch.equal(a, b) for a, b in zip(after, fused["snapshots"][111], strict=True))
    plain = _fused_run(tmp_path / "plain", "skip", {110}, sync_free=False)
    assert plain["steps"] == [110]  # the device rule decides as the host rule does


def test_sync_free_warn_is_judged_on_the_host_a_step_late(tmp_path: Path) -> None:
    warned = _fused_run(tmp_path, "warn", {110}, sync_free=True)
    assert warned["steps"] == [110] and warned["skips"] == []
    assert warned["recorded"][110] == "ok"  # warned about, and applied
    before, after = warned["snapshots"][109], warned["snapshots"][110]
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # applied


def _continue(guard: tg.Guard, model: torch.nn.Module, batches: list[torch.Tensor]) -> None:
    for step, x in enumerate(guard.watch(batches)):
        target = torch.ones(6, 4) * (20.0 if step == 3 else 1.0)
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        guard.step(loss)
    guard.close()


@pytest.mark.parametrize("sync_free", [False, True])
def test_spike_statistics_travel_in_the_guard_state_dict(tmp_path: Path, sync_free: bool) -> None:
    """A guard restored from ``state_dict()`` judges the next values as the original does
    (sync_free: the device rule's statistics; else the host rule's)."""
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(6, 8, generator=gen) for _ in range(110)]

    def guard_for(name: str) -> tuple[tg.Guard, torch.nn.Module]:
        torch.manual_seed(0)
        model = TinyNet()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=sync_free)
        config = tg.GuardConfig(run_dir=tmp_path / name, on_spike="skip", hang_timeout=0)
        return tg.Guard(model, opt, config=config), model

    original, model = guard_for("original")
    for x in original.watch(batches[:104]):
        loss = (model(x) - torch.ones(6, 4)).pow(2).mean()
        loss.backward()
        original.step(loss)
    state = json.loads(json.dumps(original.state_dict()))  # plain data
    saved = state["state"]["spikes"]
    seen = saved["device"][0][0] if sync_free else saved["detector"]["stats"]["loss"][0]
    assert seen == 104  # values the rule has seen (loss): past its warm-up
    restored, twin = guard_for("restored")
    fresh, fresh_model = guard_for("fresh")  # the same weights, statistics not restored
    for g, m in ((restored, twin), (fresh, fresh_model)):
        m.load_state_dict(model.state_dict())
        g.optimizer.load_state_dict(original.optimizer.state_dict())
    restored.load_state_dict(state)
    _continue(original, model, batches[104:])
    _continue(restored, twin, batches[104:])
    _continue(fresh, fresh_model, batches[104:])
    spikes = {n: _events(tmp_path / n, "spike") for n in ("original", "restored", "fresh")}
    assert [e["step"] for e in spikes["original"] if e["metric"] == "loss"] == [107]
    # the same verdicts, the same baselines and scores (the twin's weights, reloaded through
    # the optimizer's state_dict, differ from the original's in the last bits)
    judged = {n: [(e["step"], e["metric"]) for e in spikes[n]] for n in spikes}
    assert judged["restored"] == judged["original"]
    for a, b in zip(spikes["restored"], spikes["original"], strict=True):
        assert a["baseline"] == pytest.approx(b["baseline"], rel=1e-3)
        assert a["score"] == pytest.approx(b["score"], rel=1e-3)
    assert spikes["fresh"] == []  # without the statistics: still in its warm-up


@pytest.mark.parametrize("sync_free", [False, True])
def test_an_escalated_spike_stops_the_run_alike_on_both_steps(
    tmp_path: Path, sync_free: bool
) -> None:
    """``check()``'s step and the sync-free one run the same apply stage: three spikes in a
    row raise SpikeError at the third and leave the stop record a restart is refused by
    (the sync-free step once kept its own copy of that stage, which wrote none)."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=sync_free)
    config = tg.GuardConfig(run_dir=tmp_path, on_spike="skip", hang_timeout=0)
    guard = tg.Guard(model, opt, config=config)
    assert (guard._parts.sync_free is not None) is sync_free
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(SpikeError) as raised:
        for step, x in enumerate(
            guard.watch([torch.randn(6, 8, generator=gen) for _ in range(125)])
        ):
            target = torch.ones(6, 4) * (20.0 if step in (110, 111, 112) else 1.0)
            loss = (model(x) - target).pow(2).mean()
            loss.backward()
            guard.step(loss)
        guard.close()
    guard.close()
    assert raised.value.step == 112
    record = json.loads((tmp_path / "stop.json").read_text())
    assert record["cause"] == "spike" and record["step"] == 112
