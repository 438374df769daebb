"""The guard across ranks where NumPy is not installed (torch does not require it): torch's
object collectives need it, the guard's own (``trainguard/objects.py``) do not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tg_dist import free_port

SCRIPT = Path(__file__).resolve().parent / "scripts" / "no_numpy.py"


@pytest.mark.timeout(120)
def test_two_ranks_agree_skip_and_capture_without_numpy(tmp_path: Path) -> None:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
        )
        cmd = [sys.executable, str(SCRIPT), str(tmp_path / "run"), str(tmp_path)]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    errors = [proc.communicate(timeout=100)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    assert "Numpy is not available" not in errors[0] + errors[1]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["oks"] == ranks[1]["oks"] == [True, True, False, True]  # the same skip
    assert ranks[0]["run"] == ranks[1]["run"] is not None  # one run id, from rank 0
    assert ranks[0]["w"] == ranks[1]["w"]  # identical weights
    (bundle,) = (tmp_path / "run" / "captures").glob("step-*")
    assert (bundle / "rank-1").is_dir() and (bundle / "rank-0").is_dir()
