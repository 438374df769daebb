"""The straggler rule on synthetic per-rank time series: noise, warm-up, the relative and the
absolute floor, hysteresis and verdict changes; and its traces in the metrics log and report."""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import trainguard as tg
from trainguard.events import EventLog, read_events
from trainguard.health import stragglers
from trainguard.health.stragglers import PhaseWindow, StragglerWatch, judge
from trainguard.report.summary import summarize
from trainguard.report.text import report_text
from trainguard.report.timing import straggler_spans
from trainguard.step.history import LOGGED_RANKS, StepHistory, timing_fields
from trainguard.step.metrics_log import MetricsLog
from trainguard.step.types import Agreement, Decision

WORLD = 4
Times = Callable[[int, int], float]
"""``(step, rank) -> seconds``."""


def _watch(tmp_path: Path, rank: int = 0, **overrides: Any) -> StragglerWatch:
    return StragglerWatch(tg.HealthConfig(**overrides), EventLog(tmp_path, rank), rank)


def _run(
    watch: StragglerWatch, steps: int, data: Times, compute: Times | None = None, world: int = WORLD
) -> None:
    compute = compute or (lambda step, rank: 0.02)
    for step in range(steps):
        watch.observe(
            step,
            [data(step, r) for r in range(world)],
            [compute(step, r) for r in range(world)],
        )


def _stragglers(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir, rank=0) if e["kind"] == "straggler"]


def _noisy(seed: int, base: float = 0.005) -> Times:
    """A busy machine: log-normal jitter, and now and then a rank stalls for 20-200 ms."""
    rng = random.Random(seed)

    def times(step: int, rank: int) -> float:
        value = base * math.exp(rng.gauss(0.0, 0.5))
        if rng.random() < 0.1:
            value += rng.uniform(0.02, 0.2)
        return value

    return times


# -- the rule ----------------------------------------------------------------------------------


def test_both_floors_must_hold() -> None:
    assert judge([0.10, 0.10, 0.10, 0.16], 1.5, 0.01).ranks == (3,)
    assert judge([0.10, 0.10, 0.10, 0.14], 1.5, 0.01).ranks == ()  # 40 ms lost, only 1.4x
    assert judge([0.010, 0.010, 0.010, 0.016], 1.5, 0.01).ranks == ()  # 1.6x, 6 ms lost
    assert judge([1e-5, 1e-5, 1e-5, 1e-3], 1.5, 0.01).ranks == ()  # 100x of nothing


def test_reference_is_the_median_rank() -> None:
    verdict = judge([0.01, 0.05], 1.5, 0.01)  # two ranks: the faster is the reference
    assert verdict.ranks == (1,)
    assert verdict.reference == pytest.approx(0.01)
    assert verdict.slowdown(1) == pytest.approx(5.0)
    assert verdict.lost(1) == pytest.approx(0.04)
    # Two slow ranks of five do not move the reference.
    assert judge([0.01, 0.05, 0.01, 0.06, 0.01], 1.5, 0.01).ranks == (1, 3)


def test_zero_times() -> None:
    assert judge([0.0] * 4, 1.5, 0.0).ranks == ()
    verdict = judge([0.0, 0.0, 0.0, 0.05], 1.5, 0.01)
    assert verdict.ranks == (3,)
    assert verdict.slowdown(3) == math.inf


def test_a_named_rank_is_held_to_lower_floors() -> None:
    medians = [0.10, 0.10, 0.10, 0.13]  # 1.3x, 30 ms: under 1.5x, over the held 1.25x
    assert judge(medians, 1.5, 0.01).ranks == ()
    assert judge(medians, 1.5, 0.01, frozenset({3})).ranks == (3,)
    assert judge([0.10, 0.10, 0.10, 0.12], 1.5, 0.01, frozenset({3})).ranks == ()
    assert judge(torch.tensor([0.1, 0.1]), 1.5, 0.01, frozenset({7})).ranks == ()  # stale


# -- the watch ---------------------------------------------------------------------------------


def test_a_slow_loader_is_named_once_after_warmup_and_window(tmp_path: Path) -> None:
    watch = _watch(tmp_path)
    _run(watch, 100, lambda step, rank: 0.045 if rank == 2 else 0.005)
    [event] = _stragglers(tmp_path)
    assert event["ranks"] == [2] and event["phase"] == "data"
    assert event["step"] == 10 + 40 - 1  # warm-up, then a full window
    assert event["slowdown"] == pytest.approx(9.0)
    assert event["lost_per_step"] == pytest.approx(0.04)
    assert event["reference_seconds"] == pytest.approx(0.005)
    assert event["per_rank"] == [
        {
            "rank": 2,
            "seconds": 0.045,
            "median_seconds": 0.045,
            "slowdown": pytest.approx(9.0),
            "lost_per_step": 0.04,
        }
    ]
    assert watch.current == {"data": [2], "compute": []}


def test_a_slow_forward_is_named_in_compute(tmp_path: Path) -> None:
    watch = _watch(tmp_path)
    _run(watch, 80, lambda s, r: 0.001, lambda step, rank: 0.06 if rank == 0 else 0.02)
    [event] = _stragglers(tmp_path)
    assert (event["ranks"], event["phase"]) == ([0], "compute")
    assert event["slowdown"] == pytest.approx(3.0)


@pytest.mark.parametrize("seed", range(5))
def test_noise_raises_nothing(tmp_path: Path, seed: int) -> None:
    watch = _watch(tmp_path)
    _run(watch, 2000, _noisy(seed), _noisy(seed + 100, base=0.05))
    assert _stragglers(tmp_path) == []


def _starved(seed: int) -> Times:
    """Four ranks on two busy cores (as measured): a 3 ms forward that takes 3-50 ms as the
    scheduler hands the cores around, independently per rank and step."""
    rng = random.Random(seed)
    return lambda step, rank: 0.003 * rng.choice([1, 1, 2, 2, 2, 3, 4, 5, 7, 10, 17])


@pytest.mark.parametrize("seed", range(5))
def test_a_starved_machine_raises_nothing(tmp_path: Path, seed: int) -> None:
    _run(_watch(tmp_path), 2000, lambda s, r: 0.0001, _starved(seed))
    assert _stragglers(tmp_path) == []


def test_on_a_starved_machine_the_median_would_name_ranks() -> None:
    """Why each rank's lower quartile is judged, not its median (the first design)."""
    window, times = PhaseWindow(40), _starved(0)
    by_median = by_quartile = 0
    for step in range(2000):
        window.add([times(step, r) for r in range(WORLD)])
        if window.full:
            medians, lows = window.stats()
            by_median += bool(judge(medians, 1.5, 0.01).ranks)
            by_quartile += bool(judge(medians, 1.5, 0.01, lows=lows).ranks)
    assert by_median > 0 and by_quartile == 0


def test_slow_in_fewer_than_three_quarters_of_the_steps_is_not_named(tmp_path: Path) -> None:
    rng = random.Random(0)
    stalls = [rng.random() < 0.6 for _ in range(400)]
    _run(_watch(tmp_path), 400, lambda step, rank: 0.1 if rank == 1 and stalls[step] else 0.005)
    assert _stragglers(tmp_path) == []


def test_slow_in_nearly_every_step_is_named(tmp_path: Path) -> None:
    rng = random.Random(0)
    stalls = [rng.random() < 0.95 for _ in range(400)]
    _run(_watch(tmp_path), 400, lambda step, rank: 0.1 if rank == 1 and stalls[step] else 0.005)
    assert [e["ranks"] for e in _stragglers(tmp_path)] == [[1]]


def test_warmup_steps_are_not_judged(tmp_path: Path) -> None:
    """A rank slow only in its first steps (compilation, a cold loader) is never named."""
    _run(_watch(tmp_path), 200, lambda step, rank: 1.0 if rank == 3 and step < 10 else 0.005)
    assert _stragglers(tmp_path) == []
    watch = _watch(tmp_path / "short", straggler_warmup=2)
    _run(watch, 200, lambda step, rank: 1.0 if rank == 3 and step < 60 else 0.005)
    assert [e["ranks"] for e in _stragglers(tmp_path / "short")] == [[3], []]


def test_verdict_changes_new_set_and_recovery(tmp_path: Path) -> None:
    def data(step: int, rank: int) -> float:
        slow = {2} if step < 100 else {1, 2} if step < 200 else set()
        return 0.05 if rank in slow else 0.005

    _run(_watch(tmp_path), 300, data)
    events = _stragglers(tmp_path)
    assert [(e["ranks"], e["recovered"]) for e in events] == [([2], []), ([1, 2], []), ([], [1, 2])]
    steps = [e["step"] for e in events]
    assert steps[0] == 49 and 100 < steps[1] < 140 and 200 < steps[2] < 240
    over = events[-1]
    assert over["phase"] == "data" and over["slowdown"] < 1.25  # how the named ranks are now


def test_hovering_at_the_threshold_does_not_flap(tmp_path: Path) -> None:
    rng = random.Random(1)
    _run(_watch(tmp_path), 1000, lambda s, r: (0.16 + rng.uniform(-0.02, 0.02)) if r == 0 else 0.1)
    assert [e["ranks"] for e in _stragglers(tmp_path)] == [[0]]


def test_off_observes_nothing(tmp_path: Path) -> None:
    _run(_watch(tmp_path, detect_stragglers=False), 100, lambda s, r: 0.05 if r == 2 else 0.005)
    assert _stragglers(tmp_path) == []


def test_a_large_world_is_judged_every_few_steps(tmp_path: Path) -> None:
    _run(_watch(tmp_path), 60, lambda s, r: 0.05 if r == 300 else 0.005, world=512)
    [event] = _stragglers(tmp_path)
    assert event["ranks"] == [300] and 49 <= event["step"] < 49 + 512 // 128


def test_every_rank_writes_the_event_rank_zero_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trainguard.health.stragglers")
    for rank in (0, 1):
        _run(_watch(tmp_path, rank=rank), 60, lambda s, r: 0.045 if r == 2 else 0.005)
    per_rank = [read_events(tmp_path, rank=r) for r in (0, 1)]
    assert [[e["ranks"] for e in events] for events in per_rank] == [[[2]], [[2]]]
    [line] = caplog.messages
    assert "step 49: straggler: rank 2 is slow waiting for its data: 9.0x the median rank" in line
    assert "loses about 0.0400 s per step" in line


# -- the metrics log and the report ------------------------------------------------------------


def _agreement(data: list[float], compute: list[float]) -> Agreement:
    world = len(data)
    return Agreement(
        loss_ranks=[],
        grad_ranks=[],
        exhausted_ranks=[],
        batches=[0] * world,
        losses=[1.0] * world,
        global_grad_norm=1.0,
        data_times=data,
        compute_times=compute,
    )


def test_metrics_lines_hold_the_times(tmp_path: Path) -> None:
    path = tmp_path / "metrics" / "rank-0.jsonl"
    history = StepHistory(8, MetricsLog(path))
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    history.record(0, _agreement([0.0123456789, 0.001], [0.02, 0.03]), Decision.OK, opt)
    history.record(1, _agreement([0.0, 0.0], [0.0, 0.0]), Decision.OK, opt)  # not timed
    history.close()
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first["data_times"] == [0.012346, 0.001] and first["compute_times"] == [0.02, 0.03]
    assert "data_times" not in second and "time_summary" not in second


def test_a_large_world_logs_a_time_summary() -> None:
    world = LOGGED_RANKS + 1
    data = [0.001] * world
    data[40] = 0.5
    fields = timing_fields(data, [0.01] * world)
    assert fields == {
        "time_summary": {
            "data": {"median": 0.001, "max": 0.5, "max_rank": 40},
            "compute": {"median": 0.01, "max": 0.01, "max_rank": 0},
        }
    }


def _write_run(run_dir: Path) -> None:
    (run_dir / "metrics").mkdir(parents=True)
    lines = [
        {
            "step": s,
            "losses": [1.0] * 3,
            "grad_norm": 1.0,
            "decision": "ok",
            "data_times": [0.001, 0.041 if s >= 10 else 0.001, 0.001],
            "compute_times": [0.02, 0.02, 0.021],
        }
        for s in range(60)
    ]
    (run_dir / "metrics" / "rank-0.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    for rank in range(3):
        log = EventLog(run_dir, rank)
        log.write("start", 0, world_size=3)
        log.write("straggler", 29, ranks=[1], phase="data", slowdown=41.0, lost_per_step=0.04)
        log.write("straggler", 50, ranks=[], phase="data", slowdown=1.0, recovered=[1])
        log.close()


def test_report_lists_stragglers_and_the_timing_table(tmp_path: Path) -> None:
    _write_run(tmp_path)
    summary = summarize(tmp_path)
    assert [(e["step"], e["ranks"]) for e in summary.stragglers] == [(29, [1]), (50, [])]
    assert [round(r["data"] * 1e3) for r in summary.timing] == [1, 41, 1]
    text = report_text(summary)
    assert (
        "stragglers  step 29: ranks [1] slow in data (41.0x the median rank, 40.0 ms lost" in text
    )
    assert "step 50: over (data): ranks [1] caught up" in text
    assert "1         41.00       20.00  straggler: data" in text
    assert straggler_spans(summary.stragglers, summary.steps) == [(1, 29, 50, "data")]
    data = summary.to_dict()
    assert data["timing"][1]["rank"] == 1 and len(data["stragglers"]) == 2


@pytest.mark.parametrize("on", [True, False])
def test_detect_stragglers_off_takes_the_timer_out(tmp_path: Path, on: bool) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = tg.GuardConfig(
        run_dir=tmp_path, hang_timeout=0, health=tg.HealthConfig(detect_stragglers=on)
    )
    with tg.Guard(model, opt, config=config) as guard:
        assert (guard._parts.timer is not None) is on
        assert not model._forward_hooks  # one process: the timer sets no module hook
        for batch in guard.watch([torch.randn(3, 4) for _ in range(3)]):
            loss = model(batch).pow(2).mean()
            loss.backward()
            guard.step(loss)
    lines = [json.loads(line) for line in (tmp_path / "metrics" / "rank-0.jsonl").open()]
    assert all(("compute_times" in line) is on for line in lines)
    if on:  # the step's time outside the fetch, from the second step on
        assert [line["compute_times"][0] > 0 for line in lines] == [False, True, True]


def test_the_timer_hooks_the_forward_only_with_other_ranks() -> None:
    from trainguard.health.timing import StepTimer

    model = torch.nn.Linear(4, 2)
    timer = StepTimer(model, forward_hooks=True)
    assert model._forward_hooks and model._forward_pre_hooks
    model(torch.randn(2, 4))
    assert timer.take()[1] > 0  # the forward, timed by its hooks
    timer.close()
    assert not model._forward_hooks and not model._forward_pre_hooks


@pytest.mark.parametrize("world", [1, 2, 5])
def test_small_worlds_on_host_floats_judge_as_the_ring_tensor(
    tmp_path: Path, world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to SMALL_WORLD ranks the window is a list per rank and the quiet steps are judged on
    host floats (fixed_cost.py, issue 26); the events are those of the tensor ring."""
    rng = random.Random(world)

    def data(step: int, rank: int) -> float:
        slow = rank == world - 1 and world > 1 and 80 <= step < 220
        return (0.06 if slow else 0.005) * math.exp(rng.gauss(0.0, 0.3))

    series = [[data(s, r) for r in range(world)] for s in range(400)]

    def events(name: str) -> list[tuple[Any, ...]]:
        watch = _watch(tmp_path / name)
        _run(watch, 400, lambda s, r: series[s][r], world=world)
        return [(e["step"], e["ranks"], e["recovered"]) for e in _stragglers(tmp_path / name)]

    on_host = events("host")
    monkeypatch.setattr(stragglers, "SMALL_WORLD", 0)  # every world on the ring tensor
    assert events("tensor") == on_host
    assert bool(on_host) == (world > 1)
