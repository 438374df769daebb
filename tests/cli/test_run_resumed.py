"""``trainguard run`` over a script that resumes from its own checkpoint (attach/resumed.py):
the guard counts on from the updates the loaded optimizer state holds, and ranks that loaded
different states are told so, on every rank, while the script runs as it would bare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tg_dist import free_port, torchrun_env
from tg_run import FAST_EXIT, TORCHRUN, run_env

SCRIPT = """
import hashlib, os, sys
import torch, torch.distributed as dist
from torch import nn

start, stop, nan_step, load_rank = map(int, sys.argv[1:5])  # load_rank -1: every rank loads
ddp = "WORLD_SIZE" in os.environ
if ddp:
    dist.init_process_group("gloo")
rank = dist.get_rank() if ddp else 0
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.AdamW(net.parameters(), lr=0.01)
if start and load_rank in (-1, rank):  # the script's own resume
    saved = torch.load(f"ck{start}.pt")
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
model = nn.parallel.DistributedDataParallel(net) if ddp else net
gen = torch.Generator()
for step in range(start, stop):
    gen.manual_seed(1000 * rank + step)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    if step == nan_step:
        x[3, 0] = float("nan")
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
if rank == 0:
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, f"ck{stop}.pt")
digest = hashlib.sha256()
for tensor in [*net.state_dict().values(), *opt.state_dict()["state"][0].values()]:
    digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
with open(f"weights-{rank}.txt", "w") as fh:  # a file a rank: stdout interleaves
    fh.write(digest.hexdigest())
if ddp:
    dist.destroy_process_group()
"""


def _run(
    cwd: Path, command: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=150, cwd=cwd, env=env or run_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _guarded(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "trainguard", "run", "--run-dir", str(run_dir), "--"]


def _weights(cwd: Path) -> list[str]:
    """Each rank's digest of its weights and moments, as the job that ran last in ``cwd``
    wrote them (and took them away)."""
    out = []
    for path in sorted(cwd.glob("weights-*.txt")):
        out.append(f"{path.stem}: {path.read_text()}")
        path.unlink()
    return out


def _events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    text = (run_dir / "events" / f"rank-{rank}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def _report(run: Path) -> tuple[str, str]:
    """``trainguard report RUN``'s text and its ``steps`` line's value."""
    report = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", str(run)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    (steps,) = [line.split(None, 1)[1] for line in report.splitlines() if "  steps " in line]
    return report, steps


@pytest.mark.timeout(200)
def test_a_script_resumed_from_its_own_checkpoint_is_counted_on_from_it(tmp_path: Path) -> None:
    """Two starts of one run: steps 0-4, then the script loads its checkpoint and trains 5-8.
    The second start is guarded from step 5 (AdamW's count), says so, numbers a NaN at the
    script's step 7 as step 7, and the report counts 9 steps, none run again; without a fault
    the weights and moments are the bare script's, bit for bit."""
    (tmp_path / "script.py").write_text(SCRIPT)
    python = [sys.executable, "script.py"]
    run = tmp_path / "run"
    _run(tmp_path, [*python, "0", "5", "-1", "-1"])
    _run(tmp_path, [*python, "5", "9", "-1", "-1"])
    bare = _weights(tmp_path)
    first = _run(tmp_path, [*_guarded(run), *python, "0", "5", "-1", "-1"])
    assert "from step" not in first.stderr
    second = _run(tmp_path, [*_guarded(run), *python, "5", "9", "-1", "-1"])
    assert _weights(tmp_path) == bare and len(bare) == 1
    assert "guarding AdamW over Sequential (49 parameters), 1 rank, from step 5 (the updates " in (
        second.stderr
    )
    loaded = [e["step"] for e in _events(run, 0) if e["kind"] == "state_loaded"]
    assert loaded == [5]
    report, steps = _report(run)
    assert steps.startswith("9 (1 rank)") and "again" not in steps, report

    nan_run = tmp_path / "nan"
    _run(tmp_path, [*_guarded(nan_run), *python, "5", "9", "7", "-1"])
    skips = [e["step"] for e in _events(nan_run, 0) if e["kind"] == "skip"]
    assert skips == [7]


@pytest.mark.timeout(200)
def test_ranks_that_loaded_different_optimizer_states_are_told_on_every_rank(
    tmp_path: Path,
) -> None:
    """Rank 1 loads the checkpoint, rank 0 does not find it (a disk the ranks do not share):
    every rank's line names both counts, each rank's events hold the same resume_mismatch,
    the guard counts from 0 on both, and the job's weights are the bare job's."""
    (tmp_path / "script.py").write_text(SCRIPT)
    _run(tmp_path, [sys.executable, "script.py", "0", "5", "-1", "-1"])

    def torchrun(*script: str) -> list[str]:
        return [
            TORCHRUN,
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{free_port()}",
            "--monitor-interval=0.2",
            *script,
            "5",
            "9",
            "-1",
            "1",
        ]

    _run(tmp_path, torchrun(str(FAST_EXIT), "script.py"))
    bare = _weights(tmp_path)
    run = tmp_path / "run"
    guarded = _run(tmp_path, [*_guarded(run), *torchrun("script.py")])
    assert _weights(tmp_path) == bare and len(bare) == 2
    told = [line for line in guarded.stderr.splitlines() if "different update counts" in line]
    assert sorted(line.split(":")[1] for line in told) == [" rank 0", " rank 1"], told
    assert all("(rank 0: 0, rank 1: 5)" in line for line in told), told
    for rank in (0, 1):
        events = _events(run, rank)
        mismatch = [e for e in events if e["kind"] == "resume_mismatch"]
        assert [(e["step"], e["updates"]) for e in mismatch] == [(0, [0, 5])]
        assert not [e for e in events if e["kind"] == "state_loaded"]


RESTARTED = """
import hashlib, os, sys
import torch, torch.distributed as dist
from torch import nn

stop, every, kill_step = map(int, sys.argv[1:4])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.AdamW(net.parameters(), lr=0.01)
start = 0
if os.path.exists("ck.pt"):  # the script's own resume, after torchrun restarted it
    saved = torch.load("ck.pt")
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    start = saved["step"]
model = nn.parallel.DistributedDataParallel(net)
gen = torch.Generator()
for step in range(start, stop):
    if step and step % every == 0 and rank == 0:
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": step}, "ck.tmp")
        os.replace("ck.tmp", "ck.pt")
    if rank == 1 and step == kill_step and not os.path.exists("killed"):
        open("killed", "w").close()
        os.kill(os.getpid(), 9)
    gen.manual_seed(1000 * rank + step)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
digest = hashlib.sha256()
for tensor in [*net.state_dict().values(), *opt.state_dict()["state"][0].values()]:
    digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
with open(f"weights-{rank}.txt", "w") as fh:  # a file a rank: stdout interleaves
    fh.write(digest.hexdigest())
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
def test_a_job_torchrun_restarts_from_the_scripts_checkpoint_is_counted_on_from_it(
    tmp_path: Path,
) -> None:
    """Rank 1 is SIGKILLed at step 6; torchrun restarts both ranks and the script loads its
    checkpoint of step 4. The restarted guard goes on from step 4 on both ranks (the same
    run), the report counts the job's 9 steps with only steps 4 and 5 run again, and the
    weights equal the bare job's killed the same way."""

    def job(folder: str, *prefix: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        cwd = tmp_path / folder
        cwd.mkdir()
        (cwd / "script.py").write_text(RESTARTED)
        script = [str(FAST_EXIT), "script.py"] if not prefix else ["script.py"]
        torchrun = [
            TORCHRUN,
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{free_port()}",
            "--monitor-interval=0.2",
        ]
        env = {**torchrun_env(), "OMP_NUM_THREADS": "1"}  # a fresh store per restart
        done = _run(cwd, [*prefix, *torchrun, *script, "9", "4", "6"], env)
        return done, _weights(cwd)

    _, bare = job("bare")
    run = tmp_path / "run"
    guarded, weights = job("guarded", *_guarded(run))
    assert weights == bare and len(bare) == 2
    resumed = [line for line in guarded.stderr.splitlines() if "from step 4 (the updates" in line]
    assert len(resumed) == 2, guarded.stderr[-3000:]
    for rank in (0, 1):
        loaded = [e["step"] for e in _events(run, rank) if e["kind"] == "state_loaded"]
        assert loaded == [4]
    # the spike statistics: rank 0's replay of what its killed first start flushed of the
    # metrics log (often nothing: the kill takes the buffered lines), the same on both ranks
    histories = [
        [(e["step"], e["steps"]) for e in _events(run, rank) if e["kind"] == "spike_history"]
        for rank in (0, 1)
    ]
    assert histories[0] == histories[1] and all(s == 4 and 0 < n <= 4 for s, n in histories[0])
    report, steps = _report(run)
    assert "2 starts" in report, report
    assert steps.startswith("9 (2 ranks)") and "(2 again after restarts)" in steps, report


SPIKY = SCRIPT.replace(
    "start, stop, nan_step, load_rank = map(int, sys.argv[1:5])",
    "start, stop, nan_step, load_rank, spike_step = map(int, sys.argv[1:6])",
).replace(
    "    if step == nan_step:\n",
    "    if step == spike_step:\n        y = y * 1000.0  # a loss spike: finite, 1e6x\n"
    "    if step == nan_step:\n",
)


@pytest.mark.timeout(200)
def test_a_resumed_script_judges_spikes_with_the_statistics_it_had(tmp_path: Path) -> None:
    """The guard's state is not in the script's checkpoint: the spike rule began anew at the
    resume, so the loss spike at step 27, two steps after it, fell in the warm-up and was
    not judged. Rank 0 learns the statistics again from the run's metrics log: the spike is
    judged as in the run that never stopped, against the same baseline, the same score."""
    assert SPIKY.count("spike_step") == 2
    (tmp_path / "script.py").write_text(SPIKY)
    python = [sys.executable, "script.py"]
    warmup = ["-o", "spikes.warmup=10"]

    def spikes(run: Path) -> list[tuple[int, str, float, float]]:
        found = [e for e in _events(run, 0) if e["kind"] == "spike"]
        return [(e["step"], e["metric"], e["baseline"], e["score"]) for e in found]

    whole = tmp_path / "whole"
    _run(tmp_path, [*_guarded(whole)[:-1], *warmup, "--", *python, "0", "30", "-1", "-1", "27"])
    expected = spikes(whole)
    assert [(step, metric) for step, metric, _, _ in expected] == [(27, "loss"), (27, "grad_norm")]

    resumed = tmp_path / "resumed"
    _run(tmp_path, [*_guarded(resumed)[:-1], *warmup, "--", *python, "0", "25", "-1", "-1", "-1"])
    _run(tmp_path, [*_guarded(resumed)[:-1], *warmup, "--", *python, "25", "30", "-1", "-1", "27"])
    assert spikes(resumed) == expected
    (history,) = [e for e in _events(resumed, 0) if e["kind"] == "spike_history"]
    assert (history["step"], history["steps"]) == (25, 25)


@pytest.mark.timeout(240)
def test_two_ranks_resume_with_rank_0s_spike_statistics(tmp_path: Path) -> None:
    """The 2-rank job of the test above, under torchrun: rank 0 alone reads the metrics log
    (it alone writes it) and broadcasts the statistics at the attach; both ranks judge the
    spike at step 27 as the job that never stopped did, with the same numbers."""
    (tmp_path / "script.py").write_text(SPIKY)
    warmup = ["-o", "spikes.warmup=10"]
    env = {**torchrun_env(), "OMP_NUM_THREADS": "1"}

    def job(run: Path, *args: str) -> None:
        torchrun = [TORCHRUN, "--nproc-per-node=2", "--rdzv-backend=c10d"]
        endpoint = f"--rdzv-endpoint=localhost:{free_port()}"
        command = [*_guarded(run)[:-1], *warmup, "--", *torchrun, endpoint, "script.py", *args]
        _run(tmp_path, command, env)

    def spikes(run: Path, rank: int) -> list[tuple[int, str, float, float]]:
        found = [e for e in _events(run, rank) if e["kind"] == "spike"]
        return [(e["step"], e["metric"], e["baseline"], e["score"]) for e in found]

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    job(whole, "0", "30", "-1", "-1", "27")
    job(resumed, "0", "25", "-1", "-1", "-1")
    job(resumed, "25", "30", "-1", "-1", "27")
    expected = spikes(whole, 0)
    assert [step for step, _, _, _ in expected] == [27, 27]
    assert spikes(whole, 1) == expected
    assert spikes(resumed, 0) == expected and spikes(resumed, 1) == expected
    for rank in (0, 1):
        (history,) = [e for e in _events(resumed, rank) if e["kind"] == "spike_history"]
        assert (history["step"], history["steps"]) == (25, 25)
