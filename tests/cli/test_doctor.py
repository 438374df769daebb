"""``trainguard doctor`` as a user runs it (one process): healthy here, an unresolvable
MASTER_ADDR named within 30 s, inconsistent launch variables, risky variables, bad usage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SECTIONS = {"environment", "variables", "rendezvous", "ranks", "smoke", "findings", "exit_code"}


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher, NCCL, gloo or torchelastic variables, plus ``extra``."""
    drop = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH and not k.startswith(drop)}
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    env.update(extra)
    return env


def _doctor(*args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=90,
        env=_clean_env(**env),
        check=False,
    )
    return out, time.monotonic() - start


def _json(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def _by_check(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for finding in report["findings"]:
        found.setdefault(finding["check"], []).append(finding)
    return found


def test_alone_on_a_healthy_machine_exits_0_with_every_section() -> None:
    out, _ = _doctor("--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = _json(out)
    assert set(report) >= SECTIONS
    assert report["healthy"] and report["exit_code"] == 0
    assert report["environment"]["torch"] == torch.__version__
    assert report["environment"]["shm"]["size_bytes"] > 0
    assert report["environment"]["open_files"]["soft"] != 0
    checks = _by_check(report)
    for check in ("environment.versions", "environment.shm", "environment.open_files"):
        assert checks[check][0]["status"] == "ok", checks[check]
    assert report["smoke"]["skipped"].startswith("single process")


def test_text_output_ends_with_the_verdict() -> None:
    out, _ = _doctor()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 failure(s), 0 warning(s): healthy (exit 0)"
    assert "Traceback" not in out.stderr


@pytest.mark.timeout(60)
def test_unresolvable_master_addr_exits_1_within_30s_naming_it() -> None:
    out, elapsed = _doctor(
        "--json", MASTER_ADDR="no-such-host.invalid", MASTER_PORT="29500", RANK="0", WORLD_SIZE="2"
    )
    assert elapsed < 30, f"took {elapsed:.1f} s"
    assert out.returncode == 1, out.stdout + out.stderr
    report = _json(out)
    (finding,) = _by_check(report)["rendezvous.master_addr"]
    assert finding["status"] == "fail"
    assert "MASTER_ADDR='no-such-host.invalid' does not resolve" in finding["message"]
    assert finding["fix"]
    assert report["smoke"] == {"skipped": "the rendezvous checks failed"}


def test_inconsistent_rank_and_world_size_is_a_finding() -> None:
    out, _ = _doctor(
        "--json", RANK="3", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"
    )
    assert out.returncode == 1
    failures = [f["message"] for f in _json(out)["findings"] if f["status"] == "fail"]
    assert failures == ["RANK=3 but WORLD_SIZE=2: ranks run 0..WORLD_SIZE-1"]


def test_risky_variables_are_findings_with_fixes() -> None:
    out, _ = _doctor(
        "--json", NCCL_P2P_DISABLE="1", NCCL_SOCKET_IFNAME="=no-such-if0", NCCL_DEBUG="INFO"
    )
    assert out.returncode == 1
    checks = _by_check(_json(out))
    assert checks["variables.NCCL_P2P_DISABLE"][0]["status"] == "warn"
    assert checks["variables.NCCL_SOCKET_IFNAME"][0]["status"] == "fail"
    assert "matches no interface" in checks["variables.NCCL_SOCKET_IFNAME"][0]["message"]
    assert checks["variables.NCCL_DEBUG"][0]["status"] == "info"
    assert checks["variables.NCCL_P2P_DISABLE"][0]["fix"]


@pytest.mark.parametrize(
    "args",
    [("--timeout", "0"), ("--bandwidth-mb", "-1")],
)
def test_bad_usage_exits_2_with_one_line(args: tuple[str, ...]) -> None:
    out, _ = _doctor(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: "), out.stderr
    assert out.stdout == ""
