"""benchmarks/flight_recorder_cost.py still runs: tiny sizes, one round, both settings
(the 2-rank jobs and the 1-rank direct measure)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "flight_recorder_cost.py"


@pytest.mark.timeout(180)
def test_flight_recorder_cost_quick(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--rounds", "1", "--steps", "2"]
    proc = subprocess.run(
        [*cmd, "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| mode | off ms | on ms | on/off |" in proc.stdout
    report = json.loads(out.read_text(encoding="utf-8"))
    (only,) = report["rounds"]
    assert only["off"]["recorded_entries"] == 0  # TORCH_FR_BUFFER_SIZE=0 reached torch
    assert only["on"]["recorded_entries"] > 0
    assert only["on"]["collectives_per_step"]["guard"] > only["on"]["collectives_per_step"]["bare"]
    assert only["off"]["solo"]["min_us"] > 0 and only["on"]["solo"]["min_us"] > 0
    assert set(report["summary"]["modes"]) == {"bare", "guard"}
    assert set(report["summary"]["direct"]["modes"]) == {"bare", "guard"}
