"""DDP's ``Join`` (uneven inputs) and the guard's per-step all-reduce (``step/join.py``): a
rank that joined early shadows DDP's collectives, not the guard's, so a guard checking a
plain loop inside ``Join`` would make gloo abort a rank (SIGABRT). The guard refuses it on
every rank before its first all-reduce; fed by ``watch()`` it works (every rank stops at the
shortest data); ``trainguard run`` stands aside and the script's Join runs as it was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tg_dist import torchrun_command, torchrun_env

import trainguard as tg

SCRIPT = Path(__file__).parent / "scripts" / "join_uneven.py"


def torchrun(*args: str, guarded_by: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = torchrun_command(SCRIPT, *args)
    if guarded_by is not None:
        guard = [sys.executable, "-m", "trainguard.cli", "run", "--run-dir", str(guarded_by)]
        command = [*guard, "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=100, env=torchrun_env())


def params(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"rank{rank}.pt")  # type: ignore[no-any-return]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(120)
def test_a_guard_checking_a_plain_loop_in_join_refuses_it_on_every_rank(tmp_path: Path) -> None:
    done = torchrun(str(tmp_path / "out"), "--mode", "guard", "--run-dir", str(tmp_path / "run"))
    assert done.returncode != 0
    assert "SIGABRT" not in done.stderr and "EnforceNotMet" not in done.stderr
    for rank in (0, 1):
        errors = [e for e in tg.read_events(tmp_path / "run", rank) if e["kind"] == "close"]
        assert errors and errors[-1]["error"].startswith(
            "ConfigError: Join: the loop trains inside DDP's Join"
        ), errors
        assert errors[-1]["step"] == 0
    assert "guard.watch(loader)" in done.stderr
    # raised on every rank by design: no rank publishes it as a peer's failure
    kinds = {e["kind"] for r in (0, 1) for e in tg.read_events(tmp_path / "run", r)}
    assert not kinds & {"failure_published", "peer_failure", "failed_too"}


@pytest.mark.timeout(120)
def test_a_guard_fed_by_watch_runs_inside_join_and_stops_every_rank_together(
    tmp_path: Path,
) -> None:
    done = torchrun(str(tmp_path / "out"), "--mode", "watch", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 STEPS 5" in done.stdout and "rank 1 STEPS 5" in done.stdout
    assert_same(params(tmp_path / "out", 0), params(tmp_path / "out", 1))


@pytest.mark.timeout(150)
def test_trainguard_run_stands_aside_for_a_join_and_the_script_runs_as_bare(
    tmp_path: Path,
) -> None:
    bare = torchrun(str(tmp_path / "bare"))
    assert bare.returncode == 0, bare.stderr[-3000:]
    done = torchrun(str(tmp_path / "out"), guarded_by=tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "EnforceNotMet" not in done.stderr
    for rank in (0, 1):
        assert (
            f"trainguard run: rank {rank}: not guarding: the loop trains inside DDP's Join"
            in done.stderr
        )
        assert_same(params(tmp_path / "bare", rank), params(tmp_path / "out", rank))
    assert "rank 0 STEPS 8" in done.stdout and "rank 1 STEPS 5" in done.stdout
