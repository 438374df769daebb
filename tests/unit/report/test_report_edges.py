"""``trainguard report`` on damaged or unusual run dirs, built by writing the JSONL files:
a killed run, a run whose events are missing, an escalation, garbage event lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainguard.report.ending import ending
from trainguard.report.summary import summarize
from trainguard.report.text import report_text

RUN = "20261127-142813-c166"


def _write(path: Path, lines: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{json.dumps(line)}\n" for line in lines), encoding="utf-8")


def _event(time: float, step: int, kind: str, **fields: Any) -> dict[str, Any]:
    return {"time": time, "rank": 0, "step": step, "kind": kind, "run": RUN, **fields}


def _metric(step: int, losses: list[Any], decision: str = "ok", grad: Any = 0.5) -> dict[str, Any]:
    return {"step": step, "losses": losses, "grad_norm": grad, "decision": decision,
            "lr": 0.01, "time": 1000.0 + step}  # fmt: skip


def _metrics(run_dir: Path, steps: int, bad: dict[int, dict[str, Any]]) -> None:
    """``steps`` lines (0..steps-1), each ok unless ``bad`` gives its line."""
    lines = [bad.get(s, _metric(s, [1.0])) for s in range(steps)]
    _write(run_dir / "metrics" / "rank-0.jsonl", lines)


def _killed_run(run_dir: Path) -> None:
    """Events up to step 4 (a capture of step 3), metrics lines up to step 46, no close."""
    _write(
        run_dir / "events" / "rank-0.jsonl",
        [
            _event(999.0, 0, "start", world_size=1),
            _event(1003.1, 3, "nonfinite", where="loss", ranks=[0], action="skip"),
            _event(1003.2, 4, "phase", phase="capture", state="enter"),
            _event(1003.3, 3, "skip", consecutive=1),
        ],
    )
    _metrics(run_dir, 47, {3: _metric(3, ["nan"], "skip", "inf")})


def _line(summary_text: str, title: str) -> str:
    return next(line for line in summary_text.splitlines() if line.startswith(f"  {title}"))


def test_a_killed_run_is_last_seen_at_the_metrics_logs_last_step(tmp_path: Path) -> None:
    """The metrics log reached step 46 while the last event named step 4."""
    _killed_run(tmp_path)
    ended = summarize(tmp_path).ended
    assert ended.startswith("no close event: the process was killed")
    assert ended.endswith("last seen at step 46")


def test_without_events_the_metrics_log_gives_decisions_and_first_bad(tmp_path: Path) -> None:
    _metrics(tmp_path, 47, {3: _metric(3, ["nan"], "skip", "inf")})
    summary = summarize(tmp_path)
    assert summary.decisions == {"ok": 46, "skip": 1}
    assert summary.first_bad is not None and summary.first_bad["step"] == 3
    assert (summary.first_bad["where"], summary.first_bad["from"]) == ("loss", "metrics")
    text = report_text(summary)
    assert "every recorded step was finite" not in text
    assert _line(text, "first bad") == (
        "  first bad   step 3: non-finite loss on ranks [0] "
        "(skip; from the metrics log: no readable events)"
    )
    assert _line(text, "non-finite") == "  non-finite  step 3: loss on ranks [0] -> skip"
    assert "killed" not in summary.ended
    assert summary.ended == (
        "unknown: no readable events (events/ missing or unreadable); "
        "the metrics log's last step is 46"
    )


def test_an_unreadable_events_file_falls_back_to_the_metrics_log(tmp_path: Path) -> None:
    """``events/rank-0.jsonl`` is a directory: counted as unreadable, the log still read;
    a step bad only in its gradients (no loss seen) has no ranks in the log."""
    (tmp_path / "events" / "rank-0.jsonl").mkdir(parents=True)
    _metrics(tmp_path, 10, {4: _metric(4, [], "skip", "inf"), 6: _metric(6, [2.0], "spike")})
    summary = summarize(tmp_path)
    assert summary.decisions == {"ok": 8, "skip": 1, "spike": 1}
    assert summary.first_bad is not None
    assert (summary.first_bad["step"], summary.first_bad["where"]) == (4, "grad")
    text = report_text(summary)
    assert _line(text, "first bad").endswith("step 4: non-finite grad (skip; from the metrics "
                                             "log: no readable events)")  # fmt: skip
    assert "events/rank-0.jsonl: unreadable (IsADirectoryError" in text
    assert summary.ended.startswith("unknown: no readable events")


def test_without_events_or_metrics_the_first_bad_step_is_unknown(tmp_path: Path) -> None:
    (tmp_path / "hangs" / "h1").mkdir(parents=True)
    (tmp_path / "hangs" / "h1" / "report.json").write_text(
        json.dumps({"id": "h1", "kind": "hang", "culprits": [1], "ranks": [{"step": 5}]})
    )
    text = report_text(summarize(tmp_path))
    assert _line(text, "first bad") == "  first bad   unknown (no readable events or metrics log)"


def test_an_escalation_ends_at_the_step_that_stopped_the_run(tmp_path: Path) -> None:
    """The close event records the guard's next step (8), which never ran: the line names
    step 7, where the escalation stopped the run."""
    error = "NonFiniteError: step 7: 5 non-finite steps in a row (max_consecutive=5)"
    _write(
        tmp_path / "events" / "rank-0.jsonl",
        [
            _event(999.0, 0, "start", world_size=1),
            *(
                _event(1000.0 + s, s, "nonfinite", where="loss", ranks=[0], action="skip")
                for s in range(3, 7)
            ),
            _event(1007.0, 7, "nonfinite", where="loss", ranks=[0], action="escalate"),
            _event(1007.1, 8, "phase", phase="capture", state="enter"),
            _event(1007.2, 7, "escalate", reason="max_consecutive", consecutive=5),
            _event(1007.3, 8, "close", total_nonfinite=5, error=error),
        ],
    )
    _metrics(tmp_path, 8, {})
    text = report_text(summarize(tmp_path))
    assert _line(text, "ended") == f"  ended       step 7: {error} (ranks [0])"


def test_an_exception_in_the_loop_ends_at_the_close_events_step() -> None:
    """A KeyError in step 30 (no stop by the guard): step 30, as the close says; a stop long
    before the close (caught, training went on) is not the step either. A non-finite step
    under ``on_nonfinite="raise"`` right before the close is."""
    start = _event(1.0, 0, "start")
    raised = _event(9.0, 30, "close", error="KeyError: 'y'")
    assert ending([start, raised], []) == "step 30: KeyError: 'y' (ranks [0])"
    old_stop = _event(2.0, 3, "escalate", reason="max_consecutive")
    assert ending([start, old_stop, raised], []).startswith("step 30: KeyError")
    policy = _event(8.0, 29, "nonfinite", action="raise")
    closed = {**raised, "error": "NonFiniteError: step 29: non-finite loss on ranks [0]"}
    assert ending([start, policy, closed], []).startswith("step 29: NonFiniteError")


def test_event_lines_with_wrong_field_types_are_unreadable(tmp_path: Path) -> None:
    """No phantom run from 1970, no "first bad step abc": such lines are counted."""
    _killed_run(tmp_path)
    path = tmp_path / "events" / "rank-0.jsonl"
    garbage = [
        {"kind": "nonfinite", "step": "abc"},
        {"time": "x", "rank": 0, "step": 2, "kind": "skip"},
        {"time": 1003.0, "rank": "0", "step": 2, "kind": "skip", "run": RUN},
        {"time": 1003.0, "rank": 0, "step": 2.5, "kind": "skip", "run": RUN},
        {"time": 1003.0, "rank": 0, "step": True, "kind": "skip", "run": RUN},
        {"time": 1003.0, "rank": 0, "step": 2, "kind": 7, "run": RUN},
        {"time": 1003.0, "rank": 0, "step": 2, "run": RUN},
    ]
    with path.open("a", encoding="utf-8") as out:
        out.writelines(f"{json.dumps(line)}\n" for line in garbage)
    summary = summarize(tmp_path)
    assert [r["id"] for r in summary.runs] == [RUN]
    assert summary.first_bad is not None and summary.first_bad["step"] == 3
    assert [e["step"] for e in summary.nonfinite] == [3]
    assert summary.decisions == {"ok": 46, "skip": 1}
    assert summary.skipped.lines == {"events/rank-0.jsonl": len(garbage)}
    assert "events/rank-0.jsonl: 7 unreadable lines" in report_text(summary)


def test_an_event_with_a_null_step_is_read(tmp_path: Path) -> None:
    """``EventLog.write(kind, None)`` is allowed: a null step is no garbage."""
    _killed_run(tmp_path)
    with (tmp_path / "events" / "rank-0.jsonl").open("a", encoding="utf-8") as out:
        out.write(json.dumps(_event(1004.0, 0, "note") | {"step": None}) + "\n")
    summary = summarize(tmp_path)
    assert summary.skipped.lines == {}
    assert summary.events == 5


def test_a_hang_says_which_ranks_left_no_stack(tmp_path: Path) -> None:
    """report.json names a stack file for every rank; a rank SIGKILLed before it dumped
    leaves its pre-opened file empty (rank 1), one that raised leaves none (rank 3, on the
    reporter's host), and another host's file is not here (rank 2): the hangs line says so
    instead of pointing at nothing."""
    folder = tmp_path / "hangs" / "h1"
    folder.mkdir(parents=True)
    ranks = [
        {"rank": r, "step": 5, "stack_file": f"rank-{r}.txt", "host": "b" if r == 2 else "a"}
        for r in range(4)
    ]
    report = {"id": "h1", "kind": "peer_failure", "culprits": [1], "reporter": 0, "ranks": ranks}
    (folder / "report.json").write_text(json.dumps(report))
    (folder / "rank-0.txt").write_text('Thread 0x1 (most recent call first):\n  File "t.py"\n')
    (folder / "rank-1.txt").write_text("")
    line = _line(report_text(summarize(tmp_path)), "hangs")
    assert line.endswith(
        "(hangs/h1); no stack from rank 1, 3 (it ended before it could write one: killed, "
        "aborted or its own exception); stacks of rank 2 are on their own hosts"
    ), line
    for rank in (1, 2, 3):
        (folder / f"rank-{rank}.txt").write_text(f"Thread 0x{rank} (most recent call first):\n")
    assert _line(report_text(summarize(tmp_path)), "hangs").endswith("(hangs/h1)")


def test_a_hangs_step_is_the_ranks_own_not_their_heartbeats(tmp_path: Path) -> None:
    """Heartbeats are a second old: a rank that failed at step 20 within its first second
    read as step 0 in report.json. The ranks' own peer_failure events say 20."""
    folder = tmp_path / "hangs" / "h1"
    folder.mkdir(parents=True)
    ranks = [{"rank": r, "step": 0, "stack_file": f"rank-{r}.txt"} for r in range(2)]
    report = {"id": "h1", "kind": "peer_failure", "culprits": [1], "reporter": 0, "ranks": ranks}
    (folder / "report.json").write_text(json.dumps(report))
    for rank in range(2):
        _write(
            tmp_path / "events" / f"rank-{rank}.jsonl",
            [
                _event(999.0, 0, "start", world_size=2),
                _event(1000.0, 20, "peer_failure", hang_id="h1", culprits=[1], reason="x"),
            ],
        )
    assert [h["step"] for h in summarize(tmp_path).hangs] == [20]
