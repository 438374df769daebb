"""A hopeless restart is refused: under ``torchrun --max-restarts=3`` a job whose data is bad
from one position on (``scripts/hopeless_train.py``) exhausts the escalation ladder, and its
first restart, which would resume into the same failure, exits with EXIT_DO_NOT_RESTART and
stops torchrun's agent: the job ends after one restart, not three. With
``TRAINGUARD_FORCE_RESTART=1`` the restart runs (and, the data healed, finishes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tg_dist import free_port

from trainguard.events import read_events
from trainguard.exitcodes import EXIT_DO_NOT_RESTART

SCRIPT = Path(__file__).parent / "scripts" / "hopeless_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
START = re.compile(r"hopeless_train: attempt (\d+) rank (\d+) start ([0-9.]+)")


def _torchrun(
    run_dir: Path, max_restarts: int, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [
        str(TORCHRUN),
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(SCRIPT),
        str(run_dir),
        *extra,
    ]
    # A fresh rendezvous store per restart (pytorch/pytorch#135712; trainguard.distributed.elastic).
    full = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    full.pop("TRAINGUARD_FORCE_RESTART", None)
    try:
        return subprocess.run(
            command, capture_output=True, text=True, timeout=140, env={**full, **(env or {})}
        )
    except subprocess.TimeoutExpired as exc:  # say where it stood
        tail = (exc.stderr or b"")[-4000:]
        raise AssertionError(f"torchrun did not finish in 140 s: {tail!r}") from exc


def _attempts(stdout: str) -> dict[int, dict[int, float]]:
    """{attempt: {rank: start time}} from the script's start lines (ranks may interleave)."""
    out: dict[int, dict[int, float]] = {}
    for attempt, rank, when in START.findall(stdout):
        out.setdefault(int(attempt), {})[int(rank)] = float(when)
    return out


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir) if e["kind"] == kind]


@pytest.mark.timeout(150)
def test_hopeless_restart_is_refused_and_torchrun_stops(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    began = time.time()
    done = _torchrun(run_dir, 3)
    ended = time.time()
    tail = done.stderr[-3000:]
    attempts = _attempts(done.stdout)
    assert sorted(attempts) == [0, 1], f"one restart, not three: {attempts}\n{tail}"
    assert all(sorted(ranks) == [0, 1] for ranks in attempts.values())
    assert [e["rank"] for e in _events(run_dir, "start")].count(0) == 2
    # the first attempt ran into the persistent fault and gave up after the whole ladder
    rungs = [e["rung"] for e in _events(run_dir, "rollback") if e["rank"] == 0]
    assert rungs == ["rollback", "rollback+lr_backoff", "rollback+lr_backoff+reset_moments"]
    record = json.loads((run_dir / "stop.json").read_text())
    assert record["cause"] == "nonfinite" and record["attempt"] == 0
    assert record["checkpoint"] is not None and (run_dir / record["checkpoint"]).is_dir()
    assert record["bundle"] and Path(record["bundle"]).is_dir()
    # the restart resumed from that checkpoint and was refused on every rank, within seconds
    refused = _events(run_dir, "restart_refused")
    assert sorted(e["rank"] for e in refused) == [0, 1], tail
    for event in refused:
        assert event["exit_code"] == EXIT_DO_NOT_RESTART and event["attempt"] == 1
        assert event["checkpoint"] == record["checkpoint"] and event["step"] == record["step"]
    agent = next(e["agent"] for e in refused if e["rank"] == 0)
    assert agent.startswith("SIGTERM sent to torchrun's agent"), agent
    waited = max(e["time"] for e in refused) - min(attempts[1].values())
    assert waited < 15, f"the refusal came {waited:.1f} s after the restart started"
    # torchrun stopped at once: its agent got SIGTERM and did not restart again
    assert done.returncode == 1, tail
    assert "got signal: 15" in done.stderr, tail
    assert ended - max(e["time"] for e in refused) < 20
    # one line says why and how to clear it
    lines = [line for line in done.stderr.splitlines() if "refused (exit 93)" in line]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("trainguard: restart 1 refused (exit 93)"), line
    for part in (f"at step {record['step']}", "nonfinite", record["bundle"], record["checkpoint"]):
        assert part in line, (part, line)
    assert "TRAINGUARD_FORCE_RESTART=1" in line and "stop.json" in line
    print(f"torchrun took {ended - began:.1f} s; the refusal {waited:.2f} s after the restart")


@pytest.mark.timeout(150)
def test_forced_restart_gets_a_fresh_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {"TRAINGUARD_FORCE_RESTART": "1"}
    done = _torchrun(run_dir, 1, "--heal-on-restart", env=env)
    tail = done.stderr[-3000:]
    assert done.returncode == 0, tail
    assert sorted(_attempts(done.stdout)) == [0, 1]
    assert "hopeless_train: finished at step" in done.stdout
    assert not _events(run_dir, "restart_refused")
    cleared = _events(run_dir, "stop_record_cleared")
    assert sorted(e["rank"] for e in cleared) == [0, 1], tail
    assert {(e["verdict"], e["attempt"]) for e in cleared} == {("forced", 1)}
    assert not (run_dir / "stop.json").exists()  # moved aside as evidence
    kept = json.loads((run_dir / "recovery" / "stop-cleared.json").read_text())
    assert kept["cleared"]["verdict"] == "forced" and kept["cause"] == "nonfinite"
    resumed = [e for e in _events(run_dir, "resume") if e.get("from_step") is not None]
    assert {e["path"] for e in resumed} == {str(run_dir / kept["checkpoint"])}
