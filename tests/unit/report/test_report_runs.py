"""``trainguard report`` splits a run dir by run: events by their ``run``, the metrics log and
hang reports by time, captures by the run their manifest names; a legacy log is one run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_recovery import rollback_config, train

import trainguard as tg
from trainguard.report.runs import LEGACY
from trainguard.report.summary import UnknownRun, summarize, summarize_all
from trainguard.report.text import report_text


def _write(path: Path, lines: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _event(time: float, step: int, kind: str, run: str | None, **fields: Any) -> dict[str, Any]:
    event = {"time": time, "rank": 0, "step": step, "kind": kind, **fields}
    return event if run is None else {**event, "run": run}


def _metric(time: float, step: int, decision: str = "ok") -> dict[str, Any]:
    loss = "nan" if decision != "ok" else 1.0
    return {"step": step, "losses": [loss], "grad_norm": 1.0, "decision": decision, "time": time}


@pytest.fixture
def three_runs(tmp_path: Path) -> Path:
    """A legacy run (no ids; 4 steps, bad at 1), run ``b`` (6 steps, bad at 2), and run ``c``
    (3 steps, clean), one after another in one directory."""
    events = [
        _event(100.0, 0, "start", None, world_size=1),
        _event(101.0, 1, "nonfinite", None, where="loss", ranks=[0], action="skip"),
        _event(104.0, 4, "close", None),
        _event(200.0, 0, "start", "b", world_size=1),
        _event(202.0, 2, "nonfinite", "b", where="loss", ranks=[0], action="skip"),
        _event(206.0, 6, "close", "b"),
        _event(300.0, 0, "start", "c", world_size=1),
        _event(303.0, 3, "close", "c"),
    ]
    _write(tmp_path / "events" / "rank-0.jsonl", events)
    metrics = [_metric(100.5 + s, s, "skip" if s == 1 else "ok") for s in range(4)]
    metrics += [_metric(200.5 + s, s, "skip" if s == 2 else "ok") for s in range(6)]
    metrics += [_metric(300.5 + s, s) for s in range(3)]
    _write(tmp_path / "metrics" / "rank-0.jsonl", metrics)
    for name, step, run, time in (("step-00000001", 1, None, 101.0), ("step-00000002", 2, "b", 1)):
        manifest = {"step": step, "reason": "first_bad_step", "time": time}
        _write(tmp_path / "captures" / name / "manifest.json", [{**manifest, "run": run}])
    return tmp_path


def test_the_latest_run_by_default(three_runs: Path) -> None:
    summary = summarize(three_runs)
    assert summary.run == "c"
    assert (summary.steps, summary.decisions, summary.first_bad) == (3, {"ok": 3}, None)
    assert [p.step for p in summary.points] == [0, 1, 2]
    assert summary.captures == []
    assert [(r["id"], r["steps"], r["starts"]) for r in summary.runs] == [
        (LEGACY, 4, 1),
        ("b", 6, 1),
        ("c", 3, 1),
    ]
    text = report_text(summary)
    assert "run         c, started 1970-01-01 00:05:00 UTC; 3 runs here (--runs lists" in text


def test_one_run_by_id_and_the_legacy_run(three_runs: Path) -> None:
    b = summarize(three_runs, "b")
    assert (b.steps, b.decisions) == (6, {"ok": 5, "skip": 1})
    assert [p.step for p in b.points] == list(range(6))
    assert [c["path"] for c in b.captures] == ["captures/step-00000002"]  # named by the manifest
    legacy = summarize(three_runs, LEGACY)
    assert (legacy.steps, legacy.decisions) == (4, {"ok": 3, "skip": 1})
    assert [c["path"] for c in legacy.captures] == ["captures/step-00000001"]  # by time
    assert legacy.first_bad is not None and legacy.first_bad["step"] == 1
    assert "(events written before runs had ids)" in report_text(legacy)
    assert [s.run for s in summarize_all(three_runs)] == [LEGACY, "b", "c"]
    with pytest.raises(UnknownRun, match="no run 'nope'; its runs: legacy, b, c"):
        summarize(three_runs, "nope")


def test_a_dir_of_one_legacy_run_reads_as_before(three_runs: Path) -> None:
    lines = (three_runs / "events" / "rank-0.jsonl").read_text().splitlines()[:3]
    (three_runs / "events" / "rank-0.jsonl").write_text("\n".join(lines) + "\n")
    summary = summarize(three_runs)
    assert summary.run == LEGACY and len(summary.runs) == 1
    # one run: every metrics line and capture is its own, whatever the time says
    assert len(summary.points) == 6 and len(summary.captures) == 2
    assert "runs here" not in report_text(summary)


def _rollback_run(run_dir: Path, batches: int, poison: dict[int, float]) -> dict[str, Any]:
    config = rollback_config(run_dir)
    torch.manual_seed(0)
    return train(0, "plain", run_dir, batches, poison, config=config)


def test_an_escalation_answered_by_a_rollback_is_listed(tmp_path: Path) -> None:
    """A real run: step 5 ruins the weights, 3 bad steps in a row escalate, the guard rolls
    back to step 4; the report's "escalate 1" and its escalations list agree, and the steps
    run again after the rollback count as run."""
    assert _rollback_run(tmp_path, 20, {5: 1e37})["error"] is None
    summary = summarize(tmp_path)
    assert (summary.steps, summary.steps_run) == (15, 20)  # 0..8, then 4..14
    assert summary.decisions == {"ok": 17, "escalate": 1, "skip": 2}
    assert [(e["step"], e["reason"], e["outcome"]) for e in summary.escalations] == [
        (8, "non-finite", "rolled back to step 4")
    ]
    text = report_text(summary)
    assert "escalations step 8: non-finite (3 in a row) -> rolled back to step 4" in text
    assert "steps       15 (1 rank); 15 in the metrics log; 20 run (5 again" in text


def test_rollbacks_then_a_stop_are_each_an_escalation(tmp_path: Path) -> None:
    """Every batch from 6 on is NaN: three rollbacks (the ladder), then the stop."""
    nan = float("nan")
    run = _rollback_run(tmp_path, 40, {i: nan for i in range(6, 40)})
    assert run["error"] == "NonFiniteError"
    summary = summarize(tmp_path)
    outcomes = [e["outcome"] for e in summary.escalations]
    assert sorted(outcomes) == ["rolled back to step 4"] * 3 + ["stopped"]
    assert summary.decisions["escalate"] == len(summary.escalations) == 4
    closed = [e for e in tg.read_events(tmp_path, 0) if e["kind"] == "close"][-1]
    bad = sum(n for kind, n in summary.decisions.items() if kind != "ok")
    assert bad == closed["total_nonfinite"]  # every bad step counted, repeats included
    assert summary.steps_run == summary.decisions["ok"] + bad == 18
    assert summary.first_bad is not None and summary.first_bad["step"] == 6  # first in time


def test_a_new_run_from_a_saved_state_counts_its_own_steps(tmp_path: Path) -> None:
    """A second run in the directory loads the first one's guard state at step 10 (a resume
    from the loop's own checkpoint as a new run): it ran steps 10-19, one of them bad, not 20
    steps from 0."""
    from tg_models import TinyNet

    def run(start: dict[str, Any] | None, steps: range, bad: int | None) -> dict[str, Any]:
        torch.manual_seed(0)
        model = TinyNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with tg.Guard(model, opt, run_dir=tmp_path) as guard:
            if start is not None:
                guard.load_state_dict(start)
            for step in guard.watch(steps):
                x = torch.randn(6, 8) * (math.nan if step == bad else 1.0)
                loss = model(x).pow(2).mean()
                loss.backward()
                if guard.check(loss):
                    opt.step()
                opt.zero_grad()
            return guard.state_dict()

    saved = run(None, range(10), None)
    run(saved, range(10, 20), 14)
    summary = summarize(tmp_path)
    assert (summary.first_step, summary.steps, summary.steps_run) == (10, 20, 10)
    assert summary.decisions == {"ok": 9, "skip": 1}
    assert "started at step 10 (a saved state); 10 run" in report_text(summary)


def test_restarts_count_the_steps_each_start_ran(tmp_path: Path) -> None:
    """torchrun restarts into one run: without resume the second start runs from 0 again;
    with resume it begins at the checkpoint's step (its ``start`` event, after ``resume``).
    Steps run are every start's; the run began at step 0 either way."""
    restart = [
        _event(100.0, 0, "start", "r", world_size=1, run_origin="new"),
        _event(101.0, 4, "checkpoint", "r"),
        _event(200.0, 0, "start", "r", world_size=1, run_origin="restart"),
        _event(212.0, 12, "close", "r"),
    ]
    metrics = [_metric(100.5 + s, s) for s in range(7)] + [_metric(200.5 + s, s) for s in range(12)]
    _write(tmp_path / "a" / "events" / "rank-0.jsonl", restart)
    _write(tmp_path / "a" / "metrics" / "rank-0.jsonl", metrics)
    summary = summarize(tmp_path / "a")
    assert (summary.starts, summary.first_step, summary.steps, summary.steps_run) == (2, 0, 12, 19)
    assert "19 run (7 again after restarts)" in report_text(summary)
    resumed = [
        *restart[:2],
        _event(199.0, 4, "resume", "r", from_step=4),
        _event(200.0, 4, "start", "r", world_size=1, run_origin="restart"),
        restart[3],
    ]
    metrics = [_metric(100.5 + s, s) for s in range(7)] + [
        _metric(200.5 + s, s) for s in range(4, 12)
    ]
    _write(tmp_path / "b" / "events" / "rank-0.jsonl", resumed)
    _write(tmp_path / "b" / "metrics" / "rank-0.jsonl", metrics)
    summary = summarize(tmp_path / "b")
    assert (summary.starts, summary.first_step, summary.steps_run) == (2, 0, 15)
    assert summary.decisions == {"ok": 15}


def test_a_guard_taking_over_an_optimizer_made_anew_goes_on_with_its_start(
    tmp_path: Path,
) -> None:
    """``trainguard run`` hands the guard over when the script makes its optimizer anew
    (``attach/replace.py``): the successor's ``start`` carries ``handover``; the run has one
    start, its steps counted once, from 0."""
    events = [
        _event(100.0, 0, "start", "h", world_size=1, run_origin="new"),
        _event(103.0, 3, "optimizer_replaced", "h", old="SGD", new="AdamW"),
        _event(103.1, 3, "close", "h"),
        _event(103.2, 3, "start", "h", world_size=1, handover="optimizer_replaced"),
        _event(105.0, 5, "nonfinite", "h", where="grad", ranks=[0], action="skip"),
        _event(108.0, 8, "close", "h"),
    ]
    metrics = [_metric(100.5 + s, s, "skip" if s == 5 else "ok") for s in range(8)]
    _write(tmp_path / "events" / "rank-0.jsonl", events)
    _write(tmp_path / "metrics" / "rank-0.jsonl", metrics)
    summary = summarize(tmp_path)
    assert (summary.starts, summary.first_step, summary.steps, summary.steps_run) == (1, 0, 8, 8)
    assert [r["starts"] for r in summary.runs] == [1]
    assert "starts" not in report_text(summary)
