"""benchmarks/gpu_features.py still runs: on the CPU at tiny sizes (``--device cpu --quick``),
every mode of every run timed, the JSON written (the GPU numbers come from a GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_features.py"


@pytest.mark.timeout(180)
def test_gpu_features_quick_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_features.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_features
    finally:
        sys.path.remove(str(SCRIPT.parent))
    expected = {
        "fp32": gpu_features.TRANSFORMER_MODES,
        "bf16": gpu_features.TRANSFORMER_MODES,
        "bnconv": gpu_features.BNCONV_MODES,
        "bnconv_large": gpu_features.BNCONV_MODES,
    }
    assert set(report["runs"]) == set(expected)
    for run, modes in expected.items():
        got = report["runs"][run]
        assert tuple(got["modes"]) == modes and got["rounds"] >= 1
        for name, row in got["modes"].items():
            assert row["step_ms"] > 0 and len(row["samples_ms"]) == got["rounds"]
            if name not in ("bare", "bare_fused"):
                assert row["reference"] in modes and row["ratio"] > 0
    assert report["sync_counts"] == {}  # counted on CUDA only
    assert "| bnconv | min+restore |" in proc.stdout
