"""``trainguard run`` jobs of the tests: the plain script (``run_scripts/train_ddp.py``, which
imports nothing of trainguard) launched bare or guarded, one process or 2-rank DDP under
torchrun (gloo, c10d rendezvous), and the comparison of their saved results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from tg_dist import free_port

SCRIPT = Path(__file__).resolve().parent / "run_scripts" / "train_ddp.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
FAST_EXIT = Path(__file__).resolve().parents[1] / "distributed" / "scripts" / "fast_exit.py"


def run_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRAINGUARD_RUN", None)
    return env


def launch(ranks: int, bare: bool = False) -> list[str]:
    """The script's launch. ``bare``: the unguarded reference run, ended by ``fast_exit.py``
    once its results are saved: an unguarded gloo DDP process can abort at interpreter exit
    (PyTorch's exit race, pytorch/pytorch#190489; "Exit stress" in ``git show
    c2f3efe:docs/benchmarks.md``), which failed a fresh-clone suite once, and the reference is
    there for its weights, not its exit. The guarded runs keep their real exit."""
    script = [str(FAST_EXIT), str(SCRIPT)] if bare else [str(SCRIPT)]
    if ranks == 1:
        return [sys.executable, *script]
    return [
        TORCHRUN,
        f"--nproc-per-node={ranks}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{free_port()}",
        "--monitor-interval=0.2",
        *script,
    ]


def run(cmd: list[str], timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=run_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def guarded(run_dir: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "trainguard.cli", "run", "--run-dir", str(run_dir), *options]


def assert_same(out_a: Path, out_b: Path, ranks: int) -> None:
    for rank in range(ranks):
        a = torch.load(out_a / f"rank{rank}.pt")
        b = torch.load(out_b / f"rank{rank}.pt")
        assert a["model"].keys() == b["model"].keys()
        for key, value in a["model"].items():
            assert torch.equal(value, b["model"][key]), (rank, key)
        for index, state in a["optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(value, b["optimizer"]["state"][index][key]), (rank, key)
