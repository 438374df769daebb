"""``benchmarks/replica_check_cost.py`` still runs: tiny sizes, 2-rank DDP, a few rounds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_replica_check_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "replicas.json"
    script = ROOT / "benchmarks" / "replica_check_cost.py"
    cmd = [sys.executable, str(script), "--quick", "--rounds", "4", "--warmup", "1"]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    timed = data["ms_per_step"]
    assert set(timed) == {"off", "default", "every_step"}
    assert all(len(v) == 4 and all(t > 0 for t in v) for v in timed.values())
    assert data["checks"] == {"off": 0, "default": 1, "every_step": 5}  # warm-up step included
    assert data["divergence_events"] == {"off": 0, "default": 0, "every_step": 0}
    assert data["fingerprint_alone"]["ms"] > 0
    assert "default/off" in proc.stdout
