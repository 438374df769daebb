"""A rank ended by a signal, under torchrun: a collective of a different size on one rank
makes gloo abort a rank (SIGABRT) and torchrun end the other (SIGTERM). Neither can run
Python code, yet each leaves its stacks (``hang/signal_dump.py``) and ``trainguard report``
names the signal and each rank's line (``report/crashes.py``), instead of "killed"."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from tg_dist import torchrun_command, torchrun_env

from trainguard.report.summary import summarize

SCRIPT = Path(__file__).parent / "scripts" / "extra_collective.py"


def line_of(marker: str) -> str:
    lines = SCRIPT.read_text().splitlines()
    return f"{SCRIPT}:{next(i for i, line in enumerate(lines, 1) if marker in line)}"


@pytest.mark.timeout(120)
def test_an_aborted_rank_and_the_one_torchrun_ended_name_their_lines(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = torchrun_command(SCRIPT, str(run_dir))
    done = subprocess.run(command, capture_output=True, text=True, timeout=100, env=torchrun_env())
    assert done.returncode != 0
    assert "SIGABRT" in done.stderr, done.stderr[-3000:]
    summary = summarize(run_dir)
    stacks = {c["rank"]: (run_dir / c["path"]).read_text() for c in summary.crashes}
    # both ranks are accounted for: one aborted by gloo, the other ended by torchrun
    assert sorted(c["rank"] for c in summary.crashes) == [0, 1], (summary.crashes, stacks)
    by_signal = {c["signal"]: c for c in summary.crashes}
    assert sorted(by_signal) == ["SIGABRT", "SIGTERM"], summary.crashes
    aborted = by_signal["SIGABRT"]
    # the aborted rank was inside a collective, called from one of the loop's lines
    assert aborted["call"], (aborted, stacks)
    assert aborted["site"] in (line_of("EXTRA COLLECTIVE"), line_of("GUARD CHECK")), stacks
    assert summary.ended.startswith(f"rank {aborted['rank']} ended by SIGABRT (see crashes)")
    for crash in summary.crashes:
        if crash.get("error"):  # it saw its collective fail, then the launcher's SIGTERM came
            assert crash["site"] == line_of("EXTRA COLLECTIVE"), (crash, stacks)
            assert crash["step"] == 10
        elif crash["in_failure_handling"]:  # SIGTERM before its comm_error event was out
            assert crash["site"] == line_of("GUARD BLOCK"), (crash, stacks)
        else:
            sites = (line_of("EXTRA COLLECTIVE"), line_of("GUARD CHECK"))
            assert crash["site"] in sites, (crash, stacks)
    # no stray signal files from the trainguard-ended or closed ranks: one per crashed rank
    files = sorted(p.name for p in run_dir.glob("hangs/*/rank-*.signal.txt"))
    assert files == sorted(f"rank-{c['rank']}.signal.txt" for c in summary.crashes)
