"""The overhead benchmark still runs: tiny sizes, two rounds, every mode timed.

Runs ``benchmarks/overhead.py --quick`` in a subprocess (single process, and 2-rank DDP for
one workload) and checks the JSON it writes, so the benchmark cannot rot unnoticed.
"""

from __future__ import annotations

import functools
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
    "norm_allreduce",
    "guard",
    "guard_lean",
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
    _check_targets_of_runs(tmp_path / "overhead.json", len(report["targets"]))


def _check_targets_of_runs(out: Path, n_targets: int) -> None:
    """``--from-json`` with two reports: one table of both runs' targets, nothing measured."""
    cmd = [sys.executable, str(SCRIPT), "--from-json", str(out), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2 * n_targets
    assert proc.stdout.count("`python benchmarks/overhead.py --quick") == 2


@pytest.mark.skipif(sys.platform != "linux", reason="gloo spawn smoke test on Linux only")
def test_ddp_two_ranks(tmp_path: Path) -> None:
    report = _run(tmp_path, "--world", "2", "--workload", "mlp")
    (result,) = report["results"]
    assert result["world"] == 2 and result["threads"] >= 1
    _check_result(result)


def test_a_target_is_met_only_when_its_interval_is_within_the_limit() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import overhead_report
        from _common import bootstrap_ci
    finally:
        sys.path.remove(str(SCRIPT.parent))
    where = {"workload": "mlp", "world": 1}
    verdict = [
        overhead_report._target(where, "x", value, 1.01, ci)["verdict"]
        for value, ci in (
            (1.0, [0.99, 1.005]),
            (1.005, [0.99, 1.02]),
            (1.02, [1.015, 1.03]),
            (1.0, None),
            (1.02, None),
            (1.0, [0.9, None]),  # unbounded above: the baseline's overhead was lost in noise
            (1.05, [None, 1.0]),
        )
    ]
    assert verdict == ["met", "within noise", "missed", "met", "missed", "within noise", "met"]
    assert bootstrap_ci(20, lambda rounds: 2.0) == (2.0, 2.0)
    res = {"modes": {m: {"step_ms": [10.0 + (i % 3) for i in range(20)]} for m in ("bare",)}}
    res["modes"]["guard"] = {"step_ms": [11.0 + (i % 3) for i in range(20)]}
    res["modes"]["foreach_norm"] = {"step_ms": [10.0 + (i % 3) for i in range(20)]}
    stat = functools.partial(overhead_report._overheads, res, "guard", "foreach_norm", "step_ms")
    # zero baseline overhead: no bound, no crash
    assert overhead_report._ci(res, stat) == [None, None]
    assert overhead_report._interval([0.5, None]) == "0.500 .. unbounded"
    low, high = bootstrap_ci(50, lambda rounds: sum(rounds) / len(rounds))
    assert low < 24.5 < high  # the mean index of 0..49 lies inside its interval
