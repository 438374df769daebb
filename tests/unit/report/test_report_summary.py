"""The run summary behind ``trainguard report``: read from a real run, damaged files skipped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_models import TinyNet, loss_fn, make_batches

import trainguard as tg
from trainguard.report.html import report_html
from trainguard.report.plot import png_bytes
from trainguard.report.readers import REPLAY_RESULT
from trainguard.report.replays import save_replay_result
from trainguard.report.summary import summarize
from trainguard.report.text import report_text
from trainguard.testing import Fault, FaultPlan


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 12-step run with a NaN loss at step 4 and an Inf gradient at step 8 (both skipped)."""
    folder = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    inf = float("inf")
    plan = FaultPlan([Fault(step=4), Fault(step=8, where="grad", param="head.weight", value=inf)])
    with tg.Guard(model, opt, run_dir=folder) as guard:
        for batch in guard.watch(make_batches(12, seed=1)):
            step = guard.state.step
            loss = plan.loss(loss_fn(model, batch), step)
            loss.backward()
            plan.grads(model, step)
            guard.step(loss)
    return folder


def test_summary_of_a_run(run_dir: Path) -> None:
    summary = summarize(run_dir)
    assert (summary.steps, summary.world_size) == (12, 1)
    assert summary.decisions == {"ok": 10, "skip": 2}
    assert summary.first_bad is not None and summary.first_bad["step"] == 4
    assert [(e["step"], e["where"]) for e in summary.nonfinite] == [(4, "loss"), (8, "grad")]
    assert [c["step"] for c in summary.captures] == [4] and summary.captures[0]["history"]
    assert [p.step for p in summary.points] == list(range(12))
    assert summary.nonfinite_cells() == [(0, 4), (0, 8)]
    assert not summary.skipped.lines and not summary.skipped.files
    text = report_text(summary)
    assert "decisions   ok 10, skip 2" in text
    assert "step 4: non-finite loss on ranks [0] (skip)" in text


def test_a_replay_result_in_the_bundle_is_the_diagnosis(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    bundle = copy / "captures" / "step-00000004"
    result = {"reproduced": True, "summary": "NaN first in forward at log (model.py:12)"}
    assert save_replay_result(bundle, result) == bundle / REPLAY_RESULT
    assert tg.load_bundle(bundle).step == 4  # the bundle itself is unchanged (not in manifest)
    assert save_replay_result(tmp_path / "missing", result) is None  # best effort
    summary = summarize(copy)
    assert summary.captures[0]["diagnosis"] == result["summary"]
    assert "diagnosis: NaN first in forward at log (model.py:12)" in report_text(summary)


def test_torn_and_garbage_lines_are_skipped_and_counted(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    events = copy / "events" / "rank-0.jsonl"
    lines = events.read_text().splitlines()
    lines.insert(3, "garbage \x00 not json")
    events.write_text("\n".join(lines) + '\n{"time": 1.0, "rank": 0, "ste')  # a kill mid-write
    metrics = copy / "metrics" / "rank-0.jsonl"
    metrics.write_text(metrics.read_text() + "[1, 2]\n")
    summary = summarize(copy)
    assert summary.skipped.lines == {"events/rank-0.jsonl": 2, "metrics/rank-0.jsonl": 1}
    assert summary.decisions == {"ok": 10, "skip": 2}  # the rest was still read
    text = report_text(summary)
    assert "events/rank-0.jsonl: 2 unreadable lines" in text
    assert "metrics/rank-0.jsonl: 1 unreadable line" in text


def test_empty_or_foreign_directory_is_empty(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    assert summarize(tmp_path).empty
    assert summarize(tmp_path / "missing").empty


def _two_ranks_wrote(run_dir: Path, *events: dict[str, Any]) -> None:
    """``events`` (without ``rank``) in both ranks' event logs, as every rank writes them."""
    folder = run_dir / "events"
    folder.mkdir()
    for rank in (0, 1):
        lines = "".join(json.dumps({**e, "rank": rank}) + "\n" for e in events)
        (folder / f"rank-{rank}.jsonl").write_text(lines)


def test_events_written_by_every_rank_are_merged(tmp_path: Path) -> None:
    _two_ranks_wrote(
        tmp_path,
        {"time": 1.0, "step": 0, "kind": "start", "world_size": 2},
        {"time": 2.0, "step": 3, "kind": "nonfinite", "where": "loss", "ranks": [1],
         "action": "skip"},
        {"time": 2.1, "step": 3, "kind": "spike", "metric": "loss"},
        {"time": 2.1, "step": 3, "kind": "spike", "metric": "grad_norm"},
        {"time": 3.0, "step": 5, "kind": "close"},
    )  # fmt: skip
    summary = summarize(tmp_path)
    assert summary.world_size == 2 and summary.steps == 5
    assert len(summary.nonfinite) == 1 and len(summary.spikes) == 2
    assert summary.decisions == {"ok": 4, "skip": 1}
    assert summary.nonfinite_cells() == [(1, 3)]


def test_the_passes_of_a_rolled_back_run_follow_each_other(tmp_path: Path) -> None:
    """Steps 5 and 6 go bad, the run rolls back to 4 and steps 5 and 6 go bad again: the
    report lists the first pass, the rollback, then the second pass, not both step 5s
    together (issue 53: the passes came out interleaved by step number)."""
    bad = {"kind": "nonfinite", "where": "loss", "ranks": [0], "action": "skip"}
    _two_ranks_wrote(
        tmp_path,
        {"time": 1.0, "step": 0, "kind": "start", "world_size": 2},
        {**bad, "time": 2.0, "step": 5},
        {**bad, "time": 2.1, "step": 6, "action": "escalate"},
        {"time": 2.2, "step": 6, "kind": "rollback", "restored_step": 4},
        {**bad, "time": 3.0, "step": 5},
        {**bad, "time": 3.1, "step": 6},
        {"time": 4.0, "step": 9, "kind": "close"},
    )
    summary = summarize(tmp_path)
    assert [(e["step"], e["action"]) for e in summary.nonfinite] == [
        (5, "skip"),
        (6, "escalate"),
        (5, "skip"),
        (6, "skip"),
    ]
    text = report_text(summary)
    assert text.index("step 6: loss on ranks [0] -> escalate") < text.rindex("step 5: loss")


def test_a_capture_that_failed_is_reported_with_its_error(tmp_path: Path) -> None:
    """Every capture failed (e.g. an optimizer whose state_dict() raised): the report says
    so instead of 'captures none', once per step, with the error."""
    _two_ranks_wrote(
        tmp_path,
        {"time": 1.0, "step": 0, "kind": "start", "world_size": 2},
        {"time": 2.0, "step": 6, "kind": "nonfinite", "where": "loss", "ranks": [1],
         "action": "skip"},
        {"time": 2.1, "step": 6, "kind": "capture_failed",
         "error": "RuntimeError: not consolidated", "reason": "first_bad_step"},
        {"time": 3.0, "step": 9, "kind": "close"},
    )  # fmt: skip
    text = report_text(summarize(tmp_path))
    assert (
        "captures    step 6 (first_bad_step): capture failed on rank 0: "
        "RuntimeError: not consolidated" in text
    )
    assert text.count("capture failed") == 1


def test_replica_divergences_are_reported(tmp_path: Path) -> None:
    """Every rank writes the ``replica_divergence`` event: one line a check, with the
    ranks, the majority, the parameters and the action."""
    _two_ranks_wrote(
        tmp_path,
        {"time": 1.0, "step": 0, "kind": "start", "world_size": 2},
        {"time": 2.0, "step": 8, "kind": "replica_divergence", "ranks": [1],
         "params": ["fc.weight", "fc.bias", "head.weight", "head.bias"], "params_differing": 4,
         "majority_rank": 0, "tie": False, "action": "resync"},
        {"time": 3.0, "step": 12, "kind": "replica_divergence", "ranks": [0, 1],
         "params": ["fc.weight"], "params_differing": 1, "majority_rank": 0, "tie": True,
         "action": "warn"},
        {"time": 4.0, "step": 16, "kind": "close"},
    )  # fmt: skip
    text = report_text(summarize(tmp_path))
    assert (
        "replicas    step 8: ranks [1] differ from rank 0 in fc.weight, fc.bias, head.weight "
        "and 1 more (resync)" in text
    )
    assert "step 12: ranks [0, 1] differ from a tie: no majority in fc.weight (warn)" in text


def test_page_is_self_contained_with_the_picture(run_dir: Path) -> None:
    page = report_html(summarize(run_dir))
    assert "http://" not in page and "https://" not in page
    assert '<img alt="timeline' in page and "data:image/png;base64," in page


def test_page_without_matplotlib_says_so(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import trainguard.report.html as html

    monkeypatch.setattr(html, "plot_available", lambda: False)
    page = report_html(summarize(run_dir))
    assert "matplotlib is not installed" in page and "<img" not in page
    assert "decisions   ok 10, skip 2" in page  # the summary is still there


def test_recovery_spike_and_input_events_are_reported(tmp_path: Path) -> None:
    folder = tmp_path / "events"
    folder.mkdir()
    lines = [
        {"time": 1.0, "rank": 0, "step": 0, "kind": "start", "world_size": 4},
        {"time": 2.0, "rank": 0, "step": 10, "kind": "checkpoint", "path": "checkpoints/s10"},
        {"time": 2.5, "rank": 0, "step": 12, "kind": "checkpoint_good", "path": "checkpoints/s10"},
        {"time": 3.0, "rank": 0, "step": 14, "kind": "bad_input", "ranks": [2], "tensors": []},
        {"time": 4.0, "rank": 0, "step": 17, "kind": "spike", "metric": "loss", "value": 9.5,
         "baseline": 1.25, "ratio": 7.6, "action": "rollback"},
        {"time": 5.0, "rank": 0, "step": 17, "kind": "rollback", "restored_step": 10,
         "rung": "rollback", "attempt": 1},
        {"time": 6.0, "rank": 0, "step": 25, "kind": "close"},
    ]  # fmt: skip
    (folder / "rank-0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = summarize(tmp_path)
    assert [e["kind"] for e in summary.checkpoints] == ["checkpoint", "checkpoint_good"]
    assert summary.nonfinite_cells() == [(2, 14)]
    text = report_text(summary)
    assert "bad input   step 14: non-finite input on ranks [2]" in text
    assert (
        "spikes      step 17: loss spike (value 9.5, baseline 1.25, ratio 7.6) -> rollback" in text
    )
    assert "rollbacks   step 17: rollback (restored_step 10, rung rollback, attempt 1)" in text
    assert "checkpoints step 10: checkpoint checkpoints/s10" in text
    assert png_bytes(summary).startswith(b"\x89PNG")  # every marker kind drawn


def test_without_matplotlib_the_text_still_works(
    run_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import sys

    from trainguard.report.command import run_report

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert run_report(copy, as_json=False, png=None, html=True) == 0
    assert "decisions   ok 10, skip 2" in capsys.readouterr().out
    assert "matplotlib is not installed" in (copy / "report.html").read_text(encoding="utf-8")
    assert run_report(copy, as_json=False, png=tmp_path / "t.png", html=False) == 2
    assert "--png needs matplotlib" in capsys.readouterr().err


def test_a_loop_without_watch_has_no_measured_data_time(tmp_path: Path) -> None:
    """``record_batch`` loops (and ``trainguard run``) fetch their batches out of the guard's
    sight: the report says the data time was not measured instead of showing 0.00 ms."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=tmp_path / "recorded") as guard:
        for batch in make_batches(4, seed=0):
            guard.record_batch(batch)
            loss = loss_fn(model, batch)
            loss.backward()
            guard.step(loss)
    text = report_text(summarize(tmp_path / "recorded"))
    assert "data time not measured (0 at every step): the loop fetched its batches" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("0 "))
    assert row.split()[1] == "-"


def test_fetches_under_a_microsecond_are_measured_data_time(tmp_path: Path) -> None:
    """A ``watch()`` over an in-memory list: most fetches log 0 (under a microsecond), the
    median is 0, and the report shows 0.00 ms rather than "not measured"."""
    from trainguard.report.timing import StepTimes, rank_table

    times = [StepTimes(data=[d], compute=[0.01]) for d in (0.0, 1e-6, 0.0)]
    [row] = rank_table(times)
    assert (row["data"], row["data_seen"]) == (0.0, True)
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, opt, run_dir=tmp_path) as guard:
        for batch in guard.watch(make_batches(3, seed=0)):
            loss = loss_fn(model, batch)
            loss.backward()
            guard.step(loss)
    summary = summarize(tmp_path)
    summary.timing = [row]
    text = report_text(summary)
    assert "data time not measured" not in text
    line = next(line for line in text.splitlines() if line.strip().startswith("0 "))
    assert line.split()[1] == "0.00"


def test_a_run_killed_before_its_metrics_were_flushed_counts_its_steps(tmp_path: Path) -> None:
    """SIGKILL in a rank-0 evaluation at step 10: the metrics log holds nothing yet, the
    events say step 10 was reached; no restart is made up to explain the difference."""
    _two_ranks_wrote(
        tmp_path,
        {"time": 1.0, "step": 0, "kind": "start", "world_size": 2},
        {"time": 2.0, "step": 10, "kind": "phase", "phase": "eval", "state": "enter"},
    )
    summary = summarize(tmp_path)
    assert (summary.steps, summary.steps_run, summary.starts) == (10, 10, 1)
    text = report_text(summary)
    assert "steps       10 (2 ranks); 0 in the metrics log\n" in text
    assert "again" not in text


def test_ranks_that_failed_too_are_listed_under_the_verdict(tmp_path: Path) -> None:
    folder = tmp_path / "events"
    folder.mkdir()
    for rank in (0, 1):
        lines = [
            {"time": 1.0, "rank": rank, "step": 0, "kind": "start", "world_size": 2},
            {"time": 2.0, "rank": rank, "step": 3, "kind": "failed_too",
             "reason": f"rank {rank} failed too: ValueError: bad"},
        ]  # fmt: skip
        (folder / f"rank-{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = report_text(summarize(tmp_path))
    assert "hangs       step 3: rank 0 failed too: ValueError: bad\n" in text
    assert "            step 3: rank 1 failed too: ValueError: bad\n" in text


def test_the_ended_line_says_how_the_last_start_ended(tmp_path: Path) -> None:
    from trainguard.report.ending import ending

    start = {"time": 1.0, "rank": 0, "step": 0, "kind": "start"}
    hang = {"kind": "hang", "step": 39}
    closed = {"time": 2.0, "rank": 0, "step": 9, "kind": "close"}
    raised = {**closed, "rank": 1, "error": "ValueError: bad"}
    dropped = {**closed, "closed": False}
    assert ending([start, closed], []) == "step 9: closed"
    assert ending([start, closed, raised], []) == "step 9: ValueError: bad (ranks [1])"
    assert ending([start, dropped], []).startswith("step 9: the guard was never closed")
    assert ending([start], [hang]) == "step 39: hang (see hangs)"
    assert ending([start, {**closed, "kind": "skip"}], []).startswith(
        "no close event: the process was killed"
    )
    # a close of an earlier start (before a torchrun restart) does not count
    assert ending([start, closed, {**start, "time": 3.0}], []).startswith("no close event")
    # rank 1 left with sys.exit (its guard never closed); the peer failure ended rank 0 with
    # os._exit (no close event): the line says the peer failure, and who left
    starts = [start, {**start, "rank": 1}]
    peer = {"kind": "peer_failure", "step": 4}
    left = {**dropped, "rank": 1}
    assert ending([*starts, left], [peer]) == (
        "step 4: peer_failure (see hangs); rank 1 left without closing its guard"
    )
    assert ending([*starts, left, closed], [peer]).startswith("step 9: the guard was never")
