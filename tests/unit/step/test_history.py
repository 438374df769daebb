"""The per-step history: the bounded ring, the metrics log and history.json in a bundle."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_models import TinyNet, loss_fn, make_batches

import trainguard as tg
from trainguard.step.history import StepHistory
from trainguard.step.hyperparams import recorded_lrs
from trainguard.step.metrics_log import MetricsLog, metrics_path, rate_stride, stride_at
from trainguard.step.types import Agreement, Decision
from trainguard.testing import Fault, FaultPlan


def _agreement(loss: float, norm: float = 1.0) -> Agreement:
    return Agreement([], [], [], [0], [loss], norm)


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = metrics_path(run_dir).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def _run(tmp_path: Path, plan: FaultPlan, n: int, fused: bool = False, **kw: Any) -> tg.Guard:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused or None)
    config = tg.GuardConfig.from_options({"run_dir": tmp_path, **kw})
    with tg.Guard(model, opt, config=config) as guard:
        for batch in guard.watch(make_batches(n, seed=1)):
            step = guard.state.step
            loss = plan.loss(loss_fn(model, batch), step)
            loss.backward()
            plan.grads(model, step)
            guard.step(loss)
    return guard


def test_ring_keeps_the_last_records_in_order() -> None:
    opt = torch.optim.SGD(TinyNet().parameters(), lr=0.5)
    history = StepHistory(capacity=3)
    for step in range(7):
        history.record(step, _agreement(float(step)), Decision.OK, opt)
    records = history.records()
    assert [r.step for r in records] == [4, 5, 6]
    assert [r.losses for r in records] == [[4.0], [5.0], [6.0]]
    assert records[0].lr == 0.5 and records[-1].step_seconds is not None
    assert history.bundle_history()["records"][-1] == {
        "step": 6,
        "losses": [6.0],
        "grad_norm": 1.0,
        "decision": "ok",
        "lr": 0.5,
        "lrs": [0.5],  # every param group's (one here)
    }


def test_history_steps_is_validated() -> None:
    with pytest.raises(tg.ConfigError, match=r"history\.steps"):
        tg.GuardConfig(history=tg.HistoryConfig(steps=0))


def test_learning_rate_of_a_device_tensor_is_not_read() -> None:
    opt = torch.optim.SGD(TinyNet().parameters(), lr=torch.tensor(0.25))
    assert recorded_lrs(opt) == (0.25, None)
    opt.param_groups[0]["lr"] = torch.tensor(0.25, device="meta")
    assert recorded_lrs(opt) == (None, None)


def test_every_groups_learning_rate_is_read_alike() -> None:
    """The first group's LR and every group's are read by the same rule: a CPU tensor LR is
    a host number in both (the per-group list once held None for it)."""
    net = TinyNet()
    groups = [{"params": [p], "lr": torch.tensor(0.5)} for p in net.parameters()]
    groups[1]["lr"] = 0.25
    opt = torch.optim.SGD(groups, lr=0.1)
    first, every = recorded_lrs(opt)
    assert first == 0.5 and every is not None and every[:2] == [0.5, 0.25]


def test_metrics_log_of_a_short_run(tmp_path: Path) -> None:
    plan = FaultPlan([Fault(step=3, where="grad", param="head.weight")])
    guard = _run(tmp_path, plan, 6)
    lines = _metrics(tmp_path)
    assert [line["step"] for line in lines] == [0, 1, 2, 3, 4, 5]
    assert [line["decision"] for line in lines] == ["ok"] * 3 + ["skip"] + ["ok"] * 2
    assert lines[3]["grad_norm"] == "inf" and math.isfinite(lines[2]["grad_norm"])
    assert set(lines[0]) == {
        "step",
        "losses",
        "grad_norm",
        "decision",
        "lr",
        "step_seconds",
        "time",
        "data_times",  # every rank's (detect_stragglers, the default)
        "compute_times",
    }
    assert lines[0]["lr"] == 1e-2 and lines[0]["step_seconds"] is None
    assert lines[1]["step_seconds"] > 0
    ring = guard.history.records()
    assert [r.losses for r in ring] == [line["losses"] for line in lines]


def test_sync_free_step_records_every_step_when_read(tmp_path: Path) -> None:
    plan = FaultPlan([Fault(step=2)])
    guard = _run(tmp_path, plan, 5, fused=True)
    assert guard._deferred
    decisions = [line["decision"] for line in _metrics(tmp_path)]
    assert decisions == ["ok", "ok", "skip", "ok", "ok"]  # the last one read at close()
    assert math.isnan(guard.history.records()[2].losses[0])


def test_bundle_history_ends_with_the_bad_step(tmp_path: Path) -> None:
    plan = FaultPlan([Fault(step=5)])
    _run(tmp_path, plan, 7, **{"history.steps": 4})
    bundle = tg.load_bundle(tmp_path / "captures" / "step-00000005")
    assert "history.json" in bundle.files  # listed with its checksum, verified on load
    history = json.loads((bundle.path / "history.json").read_text(encoding="utf-8"))
    assert history["format"] == 1
    assert [r["step"] for r in history["records"]] == [2, 3, 4, 5]
    last = history["records"][-1]
    assert last["losses"] == ["nan"] and last["decision"] == "skip"
    assert set(last) == {"step", "losses", "grad_norm", "decision", "lr", "lrs"}


@dataclass
class _Line:
    """A record as the metrics log buffers it: fields built at the flush."""

    step: int

    def log_fields(self) -> dict[str, Any]:
        return {"step": self.step}

    def log_line(self) -> str | None:
        return None


def test_metrics_batching_and_thinning(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "m.jsonl", flush_every=3, flush_seconds=1e9, dense_steps=10)
    assert [stride_at(s, 10) for s in (0, 9, 10, 99, 100)] == [1, 1, 10, 10, 100]
    for step in range(2):
        log.add(_Line(step))
    assert not log.path.exists()  # buffered
    log.add(_Line(2))
    assert len(log.path.read_text().splitlines()) == 3
    for step in range(3, 40):
        log.add(_Line(step), urgent=step == 33)  # a bad step is written at once
    assert json.loads(log.path.read_text().splitlines()[-1])["step"] == 33
    log.close()
    steps = [json.loads(line)["step"] for line in log.path.read_text().splitlines()]
    assert steps == [*range(10), 10, 20, 30, 33]


def test_a_stalled_loops_lines_are_written_from_another_thread(tmp_path: Path) -> None:
    """The hang watchdog's thread writes the lines a loop left waiting (a long evaluation,
    then a kill): ``flush_if_stale``, a second after the last flush."""
    clock = _Clock()
    log = MetricsLog(tmp_path / "m.jsonl", clock=clock)
    for step in range(3):
        log.add(_Line(step))
    log.flush_if_stale()  # not stale yet
    assert not log.path.exists()
    clock.now += 1.5
    writer = threading.Thread(target=log.flush_if_stale)
    writer.start()
    writer.join()
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [0, 1, 2]


def test_flushes_on_two_threads_lose_and_repeat_no_line(tmp_path: Path) -> None:
    log = MetricsLog(
        tmp_path / "m.jsonl", flush_every=7, dense_steps=10**6, max_lines_per_second=math.inf
    )
    done = threading.Event()

    def flush_often() -> None:
        while not done.is_set():
            log.flush()

    writer = threading.Thread(target=flush_often)
    writer.start()
    for step in range(20_000):
        log.add(_Line(step))
    done.set()
    writer.join()
    log.close()
    steps = [json.loads(line)["step"] for line in log.path.read_text().splitlines()]
    assert steps == list(range(20_000))


class _Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _offer(log: MetricsLog, clock: _Clock, steps: range, seconds: float, bad: int = -1) -> None:
    for step in steps:
        clock.now += seconds
        log.add(_Line(step), urgent=step == bad)


def _logged(log: MetricsLog) -> list[int]:
    log.close()
    return [json.loads(line)["step"] for line in log.path.read_text().splitlines()]


def test_rate_stride_takes_the_smallest_of_one_two_five() -> None:
    rates = (0.5, 100.0, 100.5, 250.0, 3333.0, 9000.0, 1e6)
    assert [rate_stride(r, 100.0) for r in rates] == [1, 1, 2, 5, 50, 100, 10_000]


def test_a_fast_loop_is_thinned_by_its_rate_past_its_first_steps(tmp_path: Path) -> None:
    clock = _Clock()
    log = MetricsLog(tmp_path / "m.jsonl", clock=clock)  # 100 lines/s past 1,000 steps
    _offer(log, clock, range(3000), 0.0003, bad=2017)  # 3,333 steps a second
    assert log.stride_by_rate == 50
    _offer(log, clock, range(3000, 3400), 0.02)  # the loop slows down: 50 steps a second
    assert log.stride_by_rate == 1
    steps = _logged(log)
    assert steps[:1100] == list(range(1100))  # rate-free, then measured at the 11th flush
    fast = [s for s in steps if 1100 <= s < 3000]
    assert 2017 in fast  # a step that is not ok is written whatever the stride
    assert [s for s in fast if s != 2017] == list(range(1100, 3000, 50))
    slow = [s for s in steps if s >= 3000]
    assert set(range(3100, 3400)) <= set(slow)  # every step again, a measure later
    assert len(slow) < 400  # thinned until that measure


def test_a_slow_loop_and_an_unlimited_log_keep_every_step(tmp_path: Path) -> None:
    clock = _Clock()
    slow = MetricsLog(tmp_path / "slow.jsonl", clock=clock)
    _offer(slow, clock, range(1500), 0.011)  # 91 steps a second
    assert _logged(slow) == list(range(1500))
    every = MetricsLog(tmp_path / "every.jsonl", clock=clock, max_lines_per_second=math.inf)
    _offer(every, clock, range(1500), 1e-6)
    assert _logged(every) == list(range(1500))
    with pytest.raises(ValueError, match="max_lines_per_second"):
        MetricsLog(tmp_path / "m.jsonl", max_lines_per_second=0.0)


def test_a_slow_loops_lines_are_on_disk_within_a_second(tmp_path: Path) -> None:
    """What a killed process (a launcher's SIGTERM) loses: the last second at most."""
    clock = _Clock()
    log = MetricsLog(tmp_path / "m.jsonl", clock=clock)
    _offer(log, clock, range(4), 0.4)  # 2.5 steps a second: flushed at step 2 (1.2 s)
    on_disk = [json.loads(line)["step"] for line in log.path.read_text().splitlines()]
    assert on_disk == [0, 1, 2]  # step 3 (0.4 s later) still buffered, not lost for long


@pytest.mark.parametrize("lines_per_second", [50.0, math.inf])
def test_the_guard_thins_its_metrics_log_by_the_option(
    tmp_path: Path, lines_per_second: float
) -> None:
    """A real loop of 1,300 steps: past the first 1,000, at most 50 lines a second (a stride
    of 2 to 200 for any step from 20 ms down to 100 us), every step with math.inf; the bad
    step is written either way, and the ring keeps every step."""
    plan = FaultPlan([Fault(step=1250)])
    guard = _run(tmp_path, plan, 1300, **{"history.metrics_lines_per_second": lines_per_second})
    steps = [line["step"] for line in _metrics(tmp_path)]
    assert steps[:1000] == list(range(1000)) and 1250 in steps
    assert [r.step for r in guard.history.records()][-256:] == list(range(1044, 1300))
    if math.isinf(lines_per_second):
        assert steps == list(range(1300))
    else:
        late = [s for s in steps if s >= 1100 and s != 1250]
        assert 1200 in late and len(late) <= 100
        assert math.gcd(*late) >= 2  # multiples of one stride


def test_a_large_world_logs_a_loss_summary(tmp_path: Path) -> None:
    from trainguard.report.summary import summarize
    from trainguard.step.history import LOGGED_RANKS

    world = LOGGED_RANKS + 1
    losses = [float(r) for r in range(world)]
    losses[7] = math.nan
    log = MetricsLog(metrics_path(tmp_path))
    history = StepHistory(capacity=4, metrics=log)
    opt = torch.optim.SGD(TinyNet().parameters(), lr=0.5)
    history.record(0, Agreement([7], [], [], [0] * world, losses, 1.0), Decision.SKIP, opt)
    history.close()
    (line,) = _metrics(tmp_path)
    assert line["losses"] is None
    assert line["loss_summary"]["nonfinite_ranks"] == [7] and line["loss_summary"]["max"] == 64.0
    assert len(history.bundle_history()["records"][0]["losses"]) == world  # the bundle keeps all
    (point,) = summarize(tmp_path).points
    assert point.bad_ranks == [7] and math.isnan(point.loss or 0.0)


def test_metrics_lines_are_the_same_text_on_the_fast_and_the_safe_path() -> None:
    """MetricsLog encodes a finite record with the C encoder directly (issue 26); a record
    with NaN/Inf goes through to_jsonable; both give what to_jsonable + dumps gives."""
    import json as json_module

    from trainguard.events import to_jsonable
    from trainguard.step.metrics_log import _line

    finite = {"step": 3, "losses": [0.5, 0.25], "grad_norm": 1.5, "decision": "ok", "lr": None}
    bad = {**finite, "losses": [float("nan"), 1.0], "grad_norm": float("inf")}
    for fields in (finite, bad):
        assert _line(fields) == json_module.dumps(to_jsonable(fields), allow_nan=False)
    assert json_module.loads(_line(bad))["grad_norm"] == "inf"


def test_log_fields_are_bundle_fields_then_timing_in_order() -> None:
    """The metrics line is built in one dict (issue 26): the keys and values it had when it
    was bundle_fields() + step_seconds/time + loss_summary + timing_fields()."""
    from trainguard.step.history import (
        LOGGED_RANKS,
        StepRecord,
        loss_summary,
        timing_fields,
    )

    def expected(rec: StepRecord) -> dict[str, Any]:
        fields = {**rec.bundle_fields(), "step_seconds": rec.step_seconds, "time": rec.time}
        lrs = fields.pop("lrs")  # in the metrics line with several groups only, at the end
        if rec.lrs is not None:
            fields["lrs"] = lrs
        if len(rec.losses) > LOGGED_RANKS:
            fields["losses"] = None
            fields["loss_summary"] = loss_summary(rec.losses)
        fields.update(timing_fields(rec.data_times, rec.compute_times))
        return fields

    many = [float(r) for r in range(LOGGED_RANKS + 1)]
    for losses, data, compute in (
        ([0.5], [], []),
        ([0.5, math.nan], [0.0, 0.0], [0.0, 0.0]),
        ([0.5, 0.25], [1e-5, 2.5e-6], [3e-5, 0.0]),
        (many, [1e-6] * len(many), [2e-6] * len(many)),
        (many, [], []),
    ):
        for lrs in (None, [0.1, 0.2]):
            rec = StepRecord(3, losses, 1.5, "ok", 0.1, None, 17.0, data, compute, lrs)
            found = rec.log_fields()
            assert list(found) == list(expected(rec))
            assert json.dumps(found) == json.dumps(expected(rec))
        if found["losses"] is not None:
            assert found["losses"] is not rec.losses  # a copy, as bundle_fields gives


def test_a_one_rank_line_is_the_text_json_gives() -> None:
    """``StepRecord.log_line`` (a world of one's every step) writes exactly what the encoder
    writes for ``log_fields()``, or declines (None) and the encoder writes it."""
    import random

    from trainguard.step.history import StepRecord
    from trainguard.step.metrics_log import _line, _text_of

    rng = random.Random(7)

    def number() -> float:
        kind = rng.randrange(5)
        if kind == 0:
            return rng.uniform(-1e3, 1e3)
        if kind == 1:
            return 10.0 ** rng.uniform(-12, 18) * rng.choice((1.0, -1.0))
        if kind == 2:
            return float(rng.randrange(-5, 5))  # integral floats: "1.0", never "1"
        if kind == 3:
            return rng.choice((0.0, -0.0, 1e16, 1e-7, 5e-324, 1.7976931348623157e308))
        return rng.random()

    fast = 0
    for index in range(3000):
        timed = rng.random() < 0.7
        losses = [number()] if rng.random() < 0.9 else []
        rec = StepRecord(
            step=rng.randrange(10**7),
            losses=losses,
            grad_norm=abs(number()),
            decision=rng.choice(["ok", "ok", "skip", "escalate"]),
            lr=rng.choice([number(), 0.001, None, 1]) if index % 7 == 0 else 1e-3 * rng.random(),
            step_seconds=None if index == 0 else abs(number()) * 1e-3,
            time=1.7e9 + rng.random() * 1e8,
            data_times=[rng.choice([0.0, rng.random() * 1e-3])] if timed else [],
            compute_times=[rng.choice([0.0, rng.random() * 1e-2])] if timed else [],
        )
        expected = _line(rec.log_fields())
        line = rec.log_line()
        if line is not None:
            fast += 1
            assert line == expected, rec
        assert _text_of(rec) == expected
        json.loads(expected)
    assert fast > 2000  # the usual record takes the direct format

    declined = [
        StepRecord(1, [math.nan], 1.0, "skip", 0.1, 0.01, 17.0, [], []),  # NaN: "nan"
        StepRecord(1, [0.5], math.inf, "skip", 0.1, 0.01, 17.0, [], []),
        StepRecord(1, [0.5, 0.25], 1.0, "ok", 0.1, 0.01, 17.0, [], []),  # two ranks
        StepRecord(1, [0.5], 1.0, "ok", None, 0.01, 17.0, [], []),  # null
        StepRecord(1, [0.5], 1.0, "ok", 0.1, 0.01, 17.0, [1e-5, 2e-5], [1e-5, 2e-5]),
    ]
    for rec in declined:
        assert rec.log_line() is None and _text_of(rec) == _line(rec.log_fields())
