"""A process killed before its batched metrics lines were written still counts every step it
ran: rank 0's last recorded step survives a SIGKILL in a memory-mapped mark, and the report
reads it (``runs/reached_mark.py``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.report.summary import summarize
from trainguard.runs.reached_mark import ReachedMark, read_marks

pytestmark = pytest.mark.timeout(120)

KILLED_AFTER = 30

LOOP = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import trainguard as tg

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = tg.Guard(model, opt, run_dir=sys.argv[1], resume=sys.argv[2] == "resume",
                     checkpoint_every=int(sys.argv[3]))
    for step in range(int(sys.argv[4])):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        if guard.check(loss):
            opt.step()
        opt.zero_grad()
    if sys.argv[5] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # the buffered metrics lines die with it
    guard.close()
    """
)


def _run(run_dir: Path, *args: str) -> int:
    command = [sys.executable, "-c", LOOP, str(run_dir), *args]
    return subprocess.run(command, capture_output=True, timeout=90).returncode


def test_a_killed_start_counts_the_steps_it_ran(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert _run(run_dir, "new", "10", str(KILLED_AFTER), "kill") == -signal.SIGKILL
    metrics = (
        (run_dir / "metrics" / "rank-0.jsonl").read_text()
        if (run_dir / "metrics" / "rank-0.jsonl").exists()
        else ""
    )
    assert len(metrics.splitlines()) < KILLED_AFTER  # lines were lost with the process
    assert summarize(run_dir).steps_run == KILLED_AFTER
    # the restart resumes from the good checkpoint of step 20: it runs 21..29 again
    assert _run(run_dir, "resume", "10", "15", "close") == 0
    summary = summarize(run_dir)
    assert summary.starts == 2 and summary.steps_run == KILLED_AFTER + 15


def test_a_torn_or_foreign_mark_is_ignored(tmp_path: Path) -> None:
    mark = ReachedMark(tmp_path)
    mark.mark(41)
    mark.close()
    mark.mark(42)  # after close: no second file
    (path,) = tmp_path.glob("reached-*.bin")
    assert [m["step"] for m in read_marks(tmp_path)] == [41]
    data = bytearray(path.read_bytes())
    data[4] ^= 0xFF  # the step's low byte changed, the check word not
    path.write_bytes(bytes(data))
    (tmp_path / "reached-1-2.bin").write_bytes(b"short")
    assert read_marks(tmp_path) == []
