"""``trainguard doctor`` on real ranks: under torchrun (2 processes, gloo) the smoke test passes
on every rank; a rank given a different variable is named by every rank; a rank that never
shows up is named within the timeout; and the same without torchrun (rank 0 hosts the store).

Each rank's stdout and stderr come from torchrun's per-rank log files (``--redirects 3``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tg_dist import free_port

WRAPPER = """
import os, sys, time
if os.environ.get("LOCAL_RANK") == "1":
    for item in filter(None, os.environ.get("TG_TEST_RANK1_ENV", "").split(";")):
        name, _, value = item.partition("=")
        os.environ[name] = value
    time.sleep(float(os.environ.get("TG_TEST_RANK1_SLEEP", "0")))
    if os.environ.get("TG_TEST_RANK1_HANG_OP"):  # stuck in host code inside that op
        import trainguard.doctor.smoke as smoke
        def hang(*args, **kwargs):
            while True:
                time.sleep(1)
        setattr(smoke, os.environ["TG_TEST_RANK1_HANG_OP"] + "_op", hang)
from trainguard.cli import main
sys.exit(main(sys.argv[1:]))
"""
DROP = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_", "TORCHELASTIC_")
LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(DROP) and k not in LAUNCH}
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    env.update(extra)
    return env


def _torchrun(
    tmp_path: Path, timeout_s: float, env: dict[str, str], limit: float = 90.0
) -> tuple[int, dict[int, dict[str, Any]], dict[int, str], float]:
    """torchrun 2 ranks of the wrapper running ``doctor --json``: exit code, each rank's
    report (those that printed one), each rank's stderr, seconds."""
    wrapper = tmp_path / "doctor_wrapper.py"
    wrapper.write_text(WRAPPER)
    logs = tmp_path / "logs"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--log-dir", str(logs), "--redirects", "3",
        str(wrapper), "doctor", "--json", "--timeout", str(timeout_s), "--bandwidth-mb", "8",
    ]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=limit)
    elapsed = time.monotonic() - start
    reports: dict[int, dict[str, Any]] = {}
    stderr: dict[int, str] = {}
    for rank in (0, 1):
        (folder,) = logs.glob(f"*/attempt_0/{rank}")
        stderr[rank] = (folder / "stderr.log").read_text()
        out = (folder / "stdout.log").read_text().strip()
        if out:
            reports[rank] = json.loads(out)
    return done.returncode, reports, stderr, elapsed


def _counted(report: dict[str, Any]) -> list[tuple[str, str, int | None]]:
    return sorted(
        (f["check"], f["status"], f["rank"])
        for f in report["findings"]
        if f["status"] in ("warn", "fail")
    )


@pytest.mark.timeout(150)
def test_torchrun_two_ranks_pass_the_smoke_test(tmp_path: Path) -> None:
    code, reports, stderr, _ = _torchrun(tmp_path, 30, _env())
    assert code == 0, (reports, stderr)
    for rank in (0, 1):
        report = reports[rank]
        assert report["exit_code"] == 0 and report["rank"] == rank, report["findings"]
        smoke = report["smoke"]
        assert smoke["backend"] == "gloo"
        for times in smoke["per_rank"].values():  # every op ran on every rank
            assert list(times) == ["all_reduce", "all_gather", "broadcast", "barrier", "bandwidth"]
        assert smoke["bandwidth"]["bytes"] == 8 * 2**20 and smoke["bandwidth"]["algbw_gbps"] > 0
        statuses = {f["check"]: f["status"] for f in report["findings"]}
        assert statuses["smoke.collectives"] == "ok" and statuses["ranks.match"] == "ok"
        assert [r["rank"] for r in report["ranks"]] == [0, 1]
        assert "terminate called" not in stderr[rank] and "Traceback" not in stderr[rank]
    assert reports[0]["smoke"]["per_rank"].keys() == reports[1]["smoke"]["per_rank"].keys()


@pytest.mark.timeout(150)
def test_a_rank_with_a_different_variable_is_named_by_every_rank(tmp_path: Path) -> None:
    env = _env(TG_TEST_RANK1_ENV="NCCL_DEBUG=INFO;NCCL_SOCKET_IFNAME=lo")
    code, reports, stderr, _ = _torchrun(tmp_path, 30, env)
    assert code != 0, reports
    expected = [("ranks.NCCL_DEBUG", "warn", 1), ("ranks.NCCL_SOCKET_IFNAME", "warn", 1)]
    for rank in (0, 1):
        report = reports[rank]
        assert report["exit_code"] == 1
        assert _counted(report) == expected, report["findings"]
        messages = [f["message"] for f in report["findings"] if f["check"] == "ranks.NCCL_DEBUG"]
        assert messages == ["NCCL_DEBUG differs: rank 1 has 'INFO'; rank 0 has it unset"]
        assert report["smoke"]["per_rank"], "the smoke test still runs"
        assert "terminate called" not in stderr[rank]


@pytest.mark.timeout(150)
def test_a_rank_that_never_shows_up_is_named_within_the_timeout(tmp_path: Path) -> None:
    env = _env(TG_TEST_RANK1_SLEEP="60")
    code, reports, _, elapsed = _torchrun(tmp_path, 5, env)
    assert code != 0
    report = reports[0]
    assert report["exit_code"] == 1
    assert _counted(report) == [("ranks.checkin", "fail", 1)]
    (finding,) = [f for f in report["findings"] if f["check"] == "ranks.checkin"]
    assert finding["message"] == "rank 1 did not check in within 5 s"
    assert report["smoke"] == {"skipped": "not every rank checked in"}
    assert elapsed < 45, f"torchrun took {elapsed:.1f} s; rank 1 sleeps 60 s"


@pytest.mark.timeout(150)
def test_a_rank_stuck_in_a_collective_is_named_and_every_rank_exits(tmp_path: Path) -> None:
    """Rank 1 never enters broadcast: rank 0's gloo broadcast times out, rank 1's deadline
    (2 x timeout) abandons the stuck thread; both report, both exit 1, nothing hangs."""
    code, reports, stderr, elapsed = _torchrun(tmp_path, 5, _env(TG_TEST_RANK1_HANG_OP="broadcast"))
    assert code != 0
    for rank in (0, 1):
        report = reports[rank]
        assert report["exit_code"] == 1
        found = {(f["check"], f["rank"]) for f in report["findings"] if f["status"] == "fail"}
        assert ("smoke.broadcast", 1) in found, report["findings"]  # rank 1 named as stuck
        assert ("smoke.broadcast", 0) in found or ("smoke.error", 0) in found
        assert report["smoke"]["per_rank"]["0"].keys() >= {"all_reduce", "all_gather"}
        assert "terminate called" not in stderr[rank]
    stuck = [f["message"] for f in reports[0]["findings"] if f["rank"] == 1]
    assert stuck == ["rank 1 was still in broadcast at the deadline"]
    assert elapsed < 60, f"{elapsed:.1f} s with --timeout 5"


def _manual(rank: int, port: int, timeout_s: float) -> subprocess.Popen[str]:
    env = _env(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    command = [sys.executable, "-m", "trainguard", "doctor", "--json", "--timeout", str(timeout_s)]
    command += ["--bandwidth-mb", "4"]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.timeout(120)
def test_without_torchrun_rank_0_hosts_the_store_and_both_pass() -> None:
    port = free_port()
    procs = [_manual(rank, port, 30) for rank in (0, 1)]
    outputs = [p.communicate(timeout=90) for p in procs]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, (out, err)
        report = json.loads(out)
        assert report["rank"] == rank and report["exit_code"] == 0
        assert report["rendezvous"]["port_role"] == ("host" if rank == 0 else "client")
        assert "terminate called" not in err


@pytest.mark.timeout(60)
def test_without_torchrun_a_missing_rank_1_is_named_by_rank_0() -> None:
    start = time.monotonic()
    proc = _manual(0, free_port(), 5)
    out, err = proc.communicate(timeout=50)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, err
    report = json.loads(out)
    assert _counted(report) == [("ranks.checkin", "fail", 1)]
    assert elapsed < 30, f"{elapsed:.1f} s with --timeout 5"
