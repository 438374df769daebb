"""The recovery cost benchmark still runs, with its within-run block test.

``benchmarks/recovery_cost.py --quick --blocks`` in a subprocess (tiny sizes, one round):
every mode timed, a checkpoint's blocking time measured, and for both recovery modes the
mean step time of the blocks with the hooks on and of those with them off.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "recovery_cost.py"


@pytest.mark.timeout(120)
def test_quick_run_with_blocks(tmp_path: Path) -> None:
    out = tmp_path / "recovery.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--rounds", "1", "--runs", "1"]
    cmd += ["--blocks", "--block", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| on / off |" in proc.stdout
    report = json.loads(out.read_text(encoding="utf-8"))
    assert set(report["seconds_per_step"]) == {
        "bare",
        "guard",
        "guard+snapshots",
        "guard+snapshots+checkpoints",
    }
    assert report["recovery_hooks_seconds_per_step"]["guard+snapshots"][0] > 0
    assert report["blocking"]["checkpoint_async_s"] > 0
    blocks = report["blocks"]
    assert set(blocks) == {"guard+snapshots", "guard+snapshots+checkpoints"}
    for mode, row in blocks.items():
        assert row["on_ms"][0] > 0 and row["off_ms"][0] > 0, mode
        assert row["ratio"] == pytest.approx(row["on_ms"][0] / row["off_ms"][0]), mode
        # the switch is what the stream and the guard call: hooks ran and were skipped
        for hook, calls in row["hook_calls"][0].items():
            assert calls["ran"] > 0 and calls["skipped"] > 0, (mode, hook, calls)
