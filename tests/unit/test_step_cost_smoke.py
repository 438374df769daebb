"""The step-cost benchmarks still run (tiny sizes, two rounds): buffer restore, rerun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_buffer_restore_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "buffers.json"
    script = ROOT / "benchmarks" / "buffer_restore_cost.py"
    cmd = [sys.executable, str(script), "--quick", "--rounds", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    for name in ("transformer", "bnconv"):
        timed = data["workloads"][name]["ms_per_step"]
        assert set(timed) == {"bare", "guard", "guard_no_restore"}
        assert all(len(v) == 2 and all(t > 0 for t in v) for v in timed.values())
    assert data["hooks"]["noop_hook_us"] > 0 and data["hooks"]["autocast_state_us"] > 0
    assert "guard/no_restore" in proc.stdout


def test_rerun_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "rerun.json"
    script = ROOT / "benchmarks" / "rerun_cost.py"
    cmd = [sys.executable, str(script), "--quick", "--rounds", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["ms_per_step"]) == {"bare", "guard", "guard_rerun"}
    assert data["rerun_step_ms"] and data["normal_step_ms"] and data["rerun_step_ratio"] > 0
