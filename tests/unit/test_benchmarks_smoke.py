"""The overhead benchmark still runs: tiny sizes, two rounds, every mode timed.

Runs ``benchmarks/overhead.py --quick`` in a subprocess (single process, and 2-rank DDP for
one workload) and checks the JSON it writes, so the benchmark cannot rot unnoticed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "overhead.py"
MODES = (
    "bare",
    "foreach_norm",
    "guard",
    "bare_clip",
    "guard_clip",
    "nancapture",
    "per_param",
    "detect_anomaly",
)


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "overhead.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu"]
    cmd += ["--rounds", "2", "--warmup", "1"]
    proc = subprocess.run(
        [*cmd, "--out", str(out), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| workload | world | mode |" in proc.stdout
    report: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return report


def _check_result(result: dict[str, Any]) -> None:
    modes = result["modes"]
    assert set(modes) == set(MODES)
    for name, mode in modes.items():
        assert mode["rounds_measured"] == 2, name
        assert mode["median_ms"] > 0, name
        assert all(t > 0 for t in mode["step_ms"]), name
        assert mode["skipped_steps"] == 0, name
        if name != "bare":
            assert mode["ratio"] > 0 and mode["overhead_ms"] is not None, name
    assert modes["guard_clip"]["reference"] == "bare_clip"
    assert modes["guard"]["guard_steps"] == 3  # warm-up + timed rounds, one step each


def test_single_process_every_mode(tmp_path: Path) -> None:
    report = _run(tmp_path, "--world", "1")
    assert {r["workload"] for r in report["results"]} == {"mlp", "transformer"}
    for result in report["results"]:
        assert result["world"] == 1
        _check_result(result)
    assert report["machine"]["cpu_count"] >= 1
    assert report["machine"]["torch"]
    assert report["targets"], "the issue's targets are evaluated"


@pytest.mark.skipif(sys.platform != "linux", reason="gloo spawn smoke test on Linux only")
def test_ddp_two_ranks(tmp_path: Path) -> None:
    report = _run(tmp_path, "--world", "2", "--workload", "mlp")
    (result,) = report["results"]
    assert result["world"] == 2 and result["threads"] >= 1
    _check_result(result)
