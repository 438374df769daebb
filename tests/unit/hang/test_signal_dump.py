"""A rank that a signal ends leaves its stacks (``hang/signal_dump.py``) and the report
names the signal and the loop's line (``report/crashes.py``)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from trainguard.report.crashes import parse_signal_dump, with_comm_errors
from trainguard.report.summary import summarize
from trainguard.report.text import report_text


def line_of(tmp_path: Path, text: str) -> str:
    """``path:line`` of the script's first line holding ``text``."""
    script = tmp_path / "loop.py"
    number = next(i for i, line in enumerate(script.read_text().splitlines(), 1) if text in line)
    return f"{script}:{number}"


def run_script(body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )


PRELUDE = """
    import os, signal, sys, time
    from pathlib import Path
    from trainguard.hang.signal_dump import SignalDump
    dump = SignalDump(Path(sys.argv[0]).parent / "hangs" / "id" / "rank-1.signal.txt")
"""


def test_a_fatal_signal_leaves_the_main_threads_line_and_keeps_its_exit_status(
    tmp_path: Path,
) -> None:
    done = run_script(
        PRELUDE
        + """
    def train_step():
        os.abort()  # what gloo does to a rank whose collective does not match its peer's

    train_step()
    """,
        tmp_path,
    )
    assert done.returncode == -signal.SIGABRT
    text = (tmp_path / "hangs" / "id" / "rank-1.signal.txt").read_text()
    assert text.startswith("Fatal Python error: Aborted")
    parsed = parse_signal_dump(text)
    assert parsed["signal"] == "SIGABRT"
    assert parsed["site"] == line_of(tmp_path, "os.abort()")


def test_sigterm_is_dumped_and_still_reaches_the_handler_it_replaced(tmp_path: Path) -> None:
    done = run_script(
        """
    import os, signal, sys, time
    from pathlib import Path
    signal.signal(signal.SIGTERM, lambda *a: (print("preemption checkpoint"), sys.exit(7)))
    from trainguard.hang.signal_dump import SignalDump
    dump = SignalDump(Path(sys.argv[0]).parent / "hangs" / "id" / "rank-1.signal.txt")

    def waiting_in_a_collective():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    waiting_in_a_collective()
    """,
        tmp_path,
    )
    assert done.returncode == 7, done.stderr
    assert "preemption checkpoint" in done.stdout
    parsed = parse_signal_dump((tmp_path / "hangs" / "id" / "rank-1.signal.txt").read_text())
    assert parsed["signal"] == "SIGTERM"
    assert parsed["site"] == line_of(tmp_path, "os.kill(")


def test_a_forked_child_and_a_closed_dump_write_nothing(tmp_path: Path) -> None:
    done = run_script(
        PRELUDE
        + """
    pid = os.fork()
    if pid == 0:  # a DataLoader worker being terminated
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status))
    dump.close()
    import faulthandler
    print("enabled", faulthandler.is_enabled())
    """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "child -15" in done.stdout
    assert "enabled False" in done.stdout
    assert not (tmp_path / "hangs" / "id" / "rank-1.signal.txt").exists()


def test_a_process_that_enabled_faulthandler_keeps_its_own_output(tmp_path: Path) -> None:
    done = run_script(
        """
    import faulthandler, os, sys
    faulthandler.enable()  # PYTHONFAULTHANDLER=1: to stderr
    from pathlib import Path
    from trainguard.hang.signal_dump import SignalDump
    SignalDump(Path(sys.argv[0]).parent / "hangs" / "id" / "rank-1.signal.txt")
    os.abort()
    """,
        tmp_path,
    )
    assert done.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in done.stderr
    assert (tmp_path / "hangs" / "id" / "rank-1.signal.txt").read_text() == ""


ABORTED = """Fatal Python error: Aborted

Thread 0x00007f700d4656c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Thread 0x00007f70321d5b80 (most recent call first):
  File "/x/site-packages/trainguard/step/consensus.py", line 174 in reduce
  File "/x/site-packages/trainguard/step/guard.py", line 211 in check
  File "/job/train.py", line 18 in <module>
"""

TERMINATED = """Current thread 0x00007f9b259bdb80 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/x/site-packages/trainguard/hang/failure.py", line 97 in publish
  File "/x/site-packages/trainguard/step/guard.py", line 384 in __exit__
  File "/job/train.py", line 11 in <module>
"""


def write_run(root: Path, now: float) -> None:
    events = root / "events"
    events.mkdir(parents=True)
    for rank in (0, 1):
        lines = [
            {"time": now, "rank": rank, "step": 0, "kind": "start", "run": "r1", "world_size": 2}
        ]
        if rank == 1:
            lines.append(
                {
                    "time": now + 1,
                    "rank": 1,
                    "step": 10,
                    "kind": "comm_error",
                    "run": "r1",
                    "error": "RuntimeError: Connection reset by peer",
                    "call": "all_reduce",
                    "site": "/job/train.py:17",
                }
            )
        (events / f"rank-{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    folder = root / "hangs" / "id"
    folder.mkdir(parents=True)
    (folder / "rank-0.signal.txt").write_text(ABORTED)
    (folder / "rank-1.signal.txt").write_text(TERMINATED)
    (folder / "rank-0.txt").write_text("")


def test_the_report_names_the_aborted_rank_and_the_line_the_other_failed_at(
    tmp_path: Path,
) -> None:
    write_run(tmp_path, time.time() - 5)
    summary = summarize(tmp_path)
    assert [c["rank"] for c in summary.crashes] == [0, 1]
    aborted, terminated = summary.crashes
    assert (aborted["signal"], aborted["site"]) == ("SIGABRT", "/job/train.py:18")
    assert aborted["call"] == "trainguard's check all_reduce"
    assert (terminated["signal"], terminated["site"], terminated["step"]) == (
        "SIGTERM",
        "/job/train.py:17",
        10,
    )
    assert summary.ended.startswith("rank 0 ended by SIGABRT (see crashes); rank 1 by SIGTERM")
    assert "killed (SIGKILL" not in summary.ended
    text = report_text(summary)
    assert (
        "crashes     rank 0: SIGABRT in trainguard's check all_reduce, called from "
        "/job/train.py:18" in text
    )
    assert "rank 1: SIGTERM after its all_reduce failed at /job/train.py:17 (step 10)" in text


def test_a_comm_error_does_not_rename_a_crash_outside_the_failure_handling() -> None:
    crash = {
        "rank": 1,
        "signal": "SIGTERM",
        "site": "/job/train.py:40",
        "in_failure_handling": False,
    }
    event = {"kind": "comm_error", "rank": 1, "site": "/job/train.py:17", "step": 3}
    assert with_comm_errors([crash], [event]) == [crash]


def test_a_rank_killed_without_a_word_is_named_before_the_ranks_the_launcher_ended(
    tmp_path: Path,
) -> None:
    """Under torchrun a SIGKILLed rank (the OOM killer) leaves nothing; the launcher then ends
    the others with SIGTERM, whose stacks are there. The killed rank is the news: it was
    never named (the line led with a bystander's SIGTERM)."""
    now = time.time() - 5
    events = tmp_path / "events"
    events.mkdir(parents=True)
    for rank in (0, 1):
        start = {"time": now, "rank": rank, "step": 0, "kind": "start", "run": "r1"}
        (events / f"rank-{rank}.jsonl").write_text(json.dumps(start) + "\n")
    folder = tmp_path / "hangs" / "id"
    folder.mkdir(parents=True)
    (folder / "rank-0.signal.txt").write_text(TERMINATED.replace("failure.py", "other.py"))
    ended = summarize(tmp_path).ended
    assert ended.startswith(
        "rank 1 ended without a close event or signal stacks (SIGKILL, the OOM killer, or "
        "os._exit); rank 0 by SIGTERM (see crashes)"
    ), ended


def test_a_sigterm_handler_installed_after_the_dump_survives_its_close(tmp_path: Path) -> None:
    """A framework sets its preemption handler once training started (after the guard):
    closing the dump must not put back the handler from before (unregistering faulthandler
    restores what it replaced, which would silently drop the framework's)."""
    done = run_script(
        PRELUDE
        + """
    signal.signal(signal.SIGTERM, lambda *a: (print("checkpoint on preemption"), sys.exit(5)))
    dump.close()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    """,
        tmp_path,
    )
    assert done.returncode == 5, done.stderr
    assert "checkpoint on preemption" in done.stdout


def test_each_fatal_signal_is_named_by_faulthandlers_words() -> None:
    words = {
        "Aborted": "SIGABRT",
        "Segmentation fault": "SIGSEGV",
        "Bus error": "SIGBUS",
        "Floating point exception": "SIGFPE",
        "Illegal instruction": "SIGILL",
    }
    for said, name in words.items():
        text = f"Fatal Python error: {said}\n\n" + TERMINATED
        assert parse_signal_dump(text)["signal"] == name


def test_an_abort_outside_a_collective_gets_no_collective_hint() -> None:
    """A native crash in a plain backward is not said to be a collective's."""
    from trainguard.hang.frames import TORCH_DIR
    from trainguard.report.crashes import crash_line

    text = (
        "Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n"
        f'  File "{TORCH_DIR}autograd/__init__.py", line 9 in backward\n'
        f'  File "{TORCH_DIR}_tensor.py", line 5 in backward\n'
        '  File "/job/train.py", line 30 in <module>\n'
    )
    crash = {"rank": 0, "path": "hangs/x/rank-0.signal.txt"} | parse_signal_dump(text)
    assert (crash["call"], crash["collective"]) == ("backward", False)
    line = crash_line(crash)
    assert line.startswith("rank 0: SIGABRT in backward, called from /job/train.py:30")
    assert "in a collective" not in line
