"""``trainguard doctor`` on torch's flight recorder, as a user runs it (one process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def doctor(**extra: str) -> dict[str, Any]:
    drop = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        check=False,
    )
    assert out.returncode in (0, 1), out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def test_the_doctor_says_how_to_turn_the_recorder_on() -> None:
    off = doctor(TORCH_FR_BUFFER_SIZE="0")
    found = [f for f in off["findings"] if f["check"] == "environment.recorder"]
    assert len(found) == 1 and found[0]["status"] == "info"
    assert "export TORCH_FR_BUFFER_SIZE=2000" in found[0]["fix"]

    unset = doctor()  # torch's default (2.13: on); importing trainguard set nothing
    found = [f for f in unset["findings"] if f["check"] == "environment.recorder"]
    assert found[0]["status"] == "ok" and "torch's default applies" in found[0]["message"]
    assert not [v for v in unset["variables"] if v["name"] == "TORCH_FR_BUFFER_SIZE"]
