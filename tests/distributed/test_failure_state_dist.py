"""A lost rank costs the step in flight: torchrun restarts resume from the state at the failure.

Each test runs ``scripts/failure_train.py`` under torchrun (2 ranks, c10d rendezvous,
``--max-restarts=2``): rank 1 is SIGKILLed or hangs at a step, the survivors write their state
at the start of that step, the killed rank's step-start record gives its RNG states and data
position, and the restart resumes at the step in flight. The final weights must be bit for bit
those of an uninterrupted run (the model has dropout: each rank's RNG matters).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import free_port

SCRIPT = Path(__file__).parent / "scripts" / "failure_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _torchrun(root: Path, name: str, *extra: str) -> Path:
    out = root / f"{name}.pt"
    command = [
        str(TORCHRUN),
        "--nproc-per-node=2",
        "--max-restarts=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(SCRIPT),
        str(root / name),
        str(out),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-4000:]
        raise AssertionError(f"torchrun did not finish in 150 s: {tail!r}") from exc
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _events(run_dir: Path, *kinds: str) -> list[dict[str, Any]]:
    from trainguard.events import read_events

    return [e for e in read_events(run_dir) if e["kind"] in kinds]


def _params(path: Path) -> torch.Tensor:
    saved = torch.load(path)
    assert saved["step"] == 60
    params: torch.Tensor = saved["params"]
    return params


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """The weights of the uninterrupted run."""
    return _params(_torchrun(tmp_path_factory.mktemp("plain"), "plain"))


def _resumes(run_dir: Path) -> set[tuple[int, int, str | None]]:
    return {(e["rank"], e["from_step"], e.get("source")) for e in _events(run_dir, "resume")}


def _job_folder_gone(run_dir: Path) -> bool:
    from trainguard.recovery.failure.store import job_folder

    return not job_folder(run_dir, None).exists()


@pytest.mark.timeout(200)
def test_a_killed_rank_resumes_at_the_step_in_flight(tmp_path: Path, plain: torch.Tensor) -> None:
    out = _torchrun(tmp_path, "killed", "--kill-at", "37")
    run = tmp_path / "killed"
    assert (0, 37, "failure_state") in _resumes(run) and (1, 37, "failure_state") in _resumes(run)
    saved = _events(run, "failure_state")
    assert [(e["rank"], e["step"], e["saved"]) for e in saved] == [(0, 37, True)]
    resumed = [e for e in _events(run, "resume") if e.get("source") == "failure_state"]
    assert {(tuple(e["saved_by"]), tuple(e["from_records"])) for e in resumed} == {((0,), (1,))}
    assert torch.equal(_params(out), plain), "resumed weights differ from the uninterrupted run"
    assert _job_folder_gone(run)  # the run ended for good: nothing left in /dev/shm


@pytest.mark.timeout(200)
def test_a_hung_rank_resumes_at_the_step_in_flight(tmp_path: Path, plain: torch.Tensor) -> None:
    out = _torchrun(tmp_path, "hung", "--hang-at", "37", "--hang-timeout", "4")
    run = tmp_path / "hung"
    assert {(r, s) for r, s, src in _resumes(run) if src == "failure_state"} == {(0, 37), (1, 37)}
    assert torch.equal(_params(out), plain)


@pytest.mark.timeout(200)
def test_two_faults_in_one_job_each_cost_the_step_in_flight(
    tmp_path: Path, plain: torch.Tensor
) -> None:
    out = _torchrun(tmp_path, "twice", "--kill-at", "20,45")
    run = tmp_path / "twice"
    steps = {s for _, s, src in _resumes(run) if src == "failure_state"}
    assert steps == {20, 45}
    assert torch.equal(_params(out), plain)


@pytest.mark.timeout(200)
def test_a_corrupted_state_is_refused_and_the_checkpoint_used(
    tmp_path: Path, plain: torch.Tensor
) -> None:
    out = _torchrun(tmp_path, "corrupt", "--kill-at", "57", "--corrupt-states")
    run = tmp_path / "corrupt"
    refused = _events(run, "failure_state_refused")
    assert {(e["rank"], e["step"]) for e in refused} == {(0, 57), (1, 57)}
    assert any("checksum" in e["reason"] for e in refused), refused
    assert {(r, s) for r, s, src in _resumes(run) if s} == {(0, 50), (1, 50)}  # the disk one
    assert torch.equal(_params(out), plain)


def _namespaces_allowed() -> bool:
    import shutil

    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


@pytest.mark.timeout(240)
@pytest.mark.skipif(not _namespaces_allowed(), reason="needs unshare -rn and ip (namespaces)")
def test_a_node_without_the_state_resumes_from_the_other_nodes(
    tmp_path: Path, plain: torch.Tensor
) -> None:
    """Two torchrun nodes in two network namespaces, each with its own run folder and state
    folder: node 1's rank is killed, and its restart gets the weights from node 0's survivor
    through the new process group (no shared folder), its own part from its record."""
    script = Path(__file__).parent / "scripts" / "two_netns_nodes.sh"
    nodes = ["unshare", "-rn", "bash", str(script), sys.executable, str(SCRIPT), str(tmp_path)]
    done = subprocess.run(
        [*nodes, "--per-node", "--kill-at", "37"],
        capture_output=True,
        text=True,
        timeout=220,
    )
    logs = "".join((tmp_path / f"log{n}.txt").read_text()[-2000:] for n in (0, 1))
    assert done.stdout.strip().endswith("rc 0 0"), done.stdout + done.stderr + logs
    node0, node1 = tmp_path / "run" / "node0", tmp_path / "run" / "node1"
    (saved,) = _events(node0, "failure_state")
    assert saved["saved"] and saved["path"].startswith(str(tmp_path / "run" / "node0-shm"))
    assert (0, 37, "failure_state") in _resumes(node0)
    assert (1, 37, "failure_state") in _resumes(node1)
    (resumed,) = [e for e in _events(node1, "resume") if e.get("source")]
    assert (resumed["saved_by"], resumed["from_records"]) == ([0], [1])
    assert torch.equal(_params(tmp_path / "out.pt"), plain)


@pytest.mark.timeout(200)
def test_an_fsdp2_job_that_loses_a_rank_resumes_from_peer_shards(tmp_path: Path) -> None:
    """FSDP2: the lost rank's shard of the step in flight is gone; its shard of the newest
    snapshot (step 30) was kept by rank 0 and written there at the failure: the restart
    resumes at step 30, every rank with its own shard, the weights those of an uninterrupted
    FSDP2 run."""
    plain = _params(_torchrun(tmp_path, "plain", "--fsdp"))
    out = _torchrun(tmp_path, "fsdp", "--fsdp", "--kill-at", "37")
    run = tmp_path / "fsdp"
    shards = {(e["step"], e["owner"]) for e in _events(run, "failure_shard") if e["saved"]}
    assert shards == {(30, 0), (30, 1)}  # rank 0's own, and the copy of rank 1's it held
    refused = _events(run, "failure_state_refused")
    assert {(e["step"], e["reason"]) for e in refused} == {
        (37, "the shards of rank(s) [1] are not there")
    }
    assert {(r, s) for r, s, src in _resumes(run) if src == "failure_state"} == {(0, 30), (1, 30)}
    assert torch.equal(_params(out), plain)
