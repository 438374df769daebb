"""benchmarks/input_check_cost.py still runs: tiny sizes, two rounds, every method timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "input_check_cost.py"


def test_input_check_cost_quick(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--rounds", "2"]
    proc = subprocess.run(
        [*cmd, "--warmup", "1", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| workload | batch, model | check ms |" in proc.stdout
    report = json.loads(out.read_text(encoding="utf-8"))
    assert set(report["workloads"]) == {"tokens", "image224", "image32", "features"}
    for name, workload in report["workloads"].items():
        for method in ("check", "foreach_f64", "naive", "forward"):
            assert len(workload["samples_ms"][method]) == 2, (name, method)
            assert workload[method]["median_ms"] > 0, (name, method)
        assert workload["check_over_forward"] > 0, name
