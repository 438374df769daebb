"""Stack dumps (all threads, the faulthandler fallback for a frozen interpreter) and the
hang report's files."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from trainguard.hang.heartbeat import RankView
from trainguard.hang.report import build_report, format_report, write_report
from trainguard.hang.rules import HANG, PEER_FAILURE, Verdict, failure_verdict
from trainguard.hang.stacks import FrozenDump, py_spy_stacks, python_stacks, write_stack_dump


def parked_in_a_named_function(release: threading.Event) -> None:
    release.wait()


def test_every_thread_is_dumped_with_its_name_and_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_PY_SPY", "0")
    release = threading.Event()
    worker = threading.Thread(
        target=parked_in_a_named_function, args=(release,), name="loader-worker"
    )
    worker.start()
    try:
        text = python_stacks()
        path = tmp_path / "hangs" / "x" / "rank-3.txt"
        assert write_stack_dump(path, "header line") is False
    finally:
        release.set()
        worker.join()
    assert text.index("--- thread MainThread") < text.index("--- thread loader-worker")
    assert "parked_in_a_named_function" in text
    dumped = path.read_text()
    assert dumped.startswith("header line\n")
    assert "test_every_thread_is_dumped" in dumped
    assert py_spy_stacks(1) is None  # disabled by TRAINGUARD_PY_SPY=0


def test_a_frozen_interpreter_still_dumps_through_faulthandler(tmp_path: Path) -> None:
    path = tmp_path / "hangs" / "id" / "rank-0.txt"
    script = textwrap.dedent(
        f"""
        import ctypes
        from pathlib import Path
        from trainguard.hang.stacks import FrozenDump

        def stuck_holding_the_gil():
            ctypes.PyDLL(None).sleep(30)  # a C call that keeps the GIL

        FrozenDump(Path({str(path)!r})).arm(0.5)
        stuck_holding_the_gil()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=60, check=False)
    assert done.returncode == 1  # faulthandler's exit after the dump
    text = path.read_text()
    assert "Timeout" in text
    assert "stuck_holding_the_gil" in text


def test_an_unused_fallback_leaves_nothing_behind(tmp_path: Path) -> None:
    dump = FrozenDump(tmp_path / "hangs" / "id" / "rank-0.txt")
    dump.arm(60.0)
    dump.close()
    assert not (tmp_path / "hangs").exists()


def test_a_fallback_does_not_remove_a_folder_with_a_report(tmp_path: Path) -> None:
    folder = tmp_path / "hangs" / "id"
    dump = FrozenDump(folder / "rank-0.txt")
    (folder / "report.json").write_text("{}")
    dump.close()
    assert (folder / "report.json").exists()


def test_report_files_name_the_culprits_and_every_rank(tmp_path: Path) -> None:
    views = [
        RankView(0, True, "running", 4, "check", False, 3.0, 0.1, 3.2, "host-a", 11),
        RankView(1, True, "running", 4, "data", False, 3.0, 0.2, 3.3, "host-b", 12),
    ]
    verdict = Verdict(HANG, [1], "no rank made progress for 3s", by=0, reporter=0)
    report = build_report("abc", verdict, views, timeout=3.0, dead_after=3.0, exit_code=91)
    path = write_report(tmp_path / "hangs" / "abc", report)

    data = json.loads(path.read_text())
    assert data["kind"] == "hang" and data["culprits"] == [1] and data["exit_code"] == 91
    assert [r["phase"] for r in data["ranks"]] == ["check", "data"]
    assert [r["culprit"] for r in data["ranks"]] == [False, True]
    assert data["ranks"][1]["stack_file"] == "rank-1.txt"
    assert data["ranks"][1]["heartbeat_age"] == 0.2
    text = (path.parent / "report.txt").read_text()
    assert text == format_report(data)
    assert "culprit ranks: 1" in text
    assert "  1*       4  data" in text
    assert not list(path.parent.glob("*.tmp"))


def _view(rank: int, state: str = "running", heartbeat_age: float = 0.1) -> RankView:
    return RankView(rank, True, state, 4, "step", False, 3.0, heartbeat_age, 0.5, "h", 10 + rank)


def test_a_peer_failure_report_says_the_culprit_failed_or_stopped() -> None:
    """A heartbeat written before the failure says ``running``: the report says what the
    verdict knows (its own exception: ``failed``; its heartbeats stopped: ``stopped``)."""
    views = [_view(0), _view(1), _view(2, "closed")]
    own = failure_verdict(1, [0, 1, 2], RuntimeError("boom"))
    states = [
        r["state"]
        for r in build_report("a", own, views, timeout=3.0, dead_after=3.0, exit_code=92)["ranks"]
    ]
    assert states == ["running", "failed", "closed"]

    views = [_view(0), _view(1, heartbeat_age=9.0), _view(2)]
    dead = Verdict(PEER_FAILURE, [1], "heartbeats stopped", by=0, reporter=0, silent=[1])
    report = build_report("b", dead, views, timeout=3.0, dead_after=3.0, exit_code=92)
    assert [r["state"] for r in report["ranks"]] == ["running", "stopped", "running"]
    assert "stopped" in format_report(report)

    hang = Verdict(HANG, [1], "no rank made progress for 3s", by=0, reporter=0, silent=[1])
    report = build_report("c", hang, views, timeout=3.0, dead_after=3.0, exit_code=91)
    assert [r["state"] for r in report["ranks"]] == ["running"] * 3  # a hang: all alive
