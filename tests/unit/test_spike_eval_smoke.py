"""benchmarks/spike_eval.py still runs: one seed of the MLP workload, short runs.

Runs the script in a subprocess and checks its JSON: the live guard's row equals the rule
replayed on the same traces, healthy runs have no spike event, the x20 targets batch is
flagged on its step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "spike_eval.py"


@pytest.mark.timeout(120)
def test_spike_eval_runs_and_scores(tmp_path: Path) -> None:
    out = tmp_path / "spike_eval.json"
    cmd = [sys.executable, str(SCRIPT), "--seeds", "1", "--steps", "200", "--inject-at", "150"]
    cmd += ["--workloads", "mlp", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| rule | false positives (healthy steps) |" in proc.stdout
    results = json.loads(out.read_text(encoding="utf-8"))["results"]
    live = results["trainguard (live Guard, default rule)"]
    assert live == results["trainguard (replayed on the trace)"]
    assert live["false_positives"] == 0 and live["healthy_steps"] == 200
    assert live["targets_x20"]["on_step"] == 1
    assert live["shift_x3"]["on_step"] == 1
