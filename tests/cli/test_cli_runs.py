"""``trainguard report`` on a run dir used by two runs of a script (how people re-run), and
``trainguard demo``'s up-front option checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys, torch, trainguard as tg
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with tg.Guard(model, opt, run_dir=sys.argv[1], hang_timeout=0) as guard:
    for i in guard.watch(range(10)):
        x = torch.randn(8, 4)
        if i == 3:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        loss.backward()
        if guard.check(loss):
            opt.step()
        opt.zero_grad()
"""


def trainguard(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "trainguard", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same 10-step script run twice with one run dir; step 3 is NaN in both."""
    folder = tmp_path_factory.mktemp("reruns")
    script = folder / "train.py"
    script.write_text(SCRIPT)
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, str(script), str(folder / "run")],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
    return folder / "run"


@pytest.mark.timeout(120)
def test_the_report_shows_the_latest_run_and_says_there_is_another(two_runs: Path) -> None:
    done = trainguard("report", str(two_runs), "--no-html")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "steps       10 (1 rank); 10 in the metrics log" in out
    assert "decisions   ok 9, skip 1" in out
    assert "first bad   step 3: non-finite loss on ranks [0] (skip)" in out
    assert "; 2 runs here (--runs lists them; --run ID or --run all)" in out
    assert out.count("(first_bad_step)") == 1


@pytest.mark.timeout(120)
def test_runs_lists_them_and_run_picks_one_or_all(two_runs: Path) -> None:
    listed = trainguard("report", str(two_runs), "--runs", "--json")
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    first, second = (r["id"] for r in data["runs"])
    assert first < second and data["latest"] == second
    assert [r["steps"] for r in data["runs"]] == [10, 10]
    text = trainguard("report", str(two_runs), "--runs").stdout
    assert first in text and f"{second} " in text and "(latest: shown by default)" in text

    chosen = json.loads(trainguard("report", str(two_runs), "--run", first, "--json").stdout)
    assert chosen["run"] == first and chosen["decisions"] == {"ok": 9, "skip": 1}
    assert [r["id"] for r in chosen["runs"]] == [first, second]

    every = trainguard("report", str(two_runs), "--run", "all", "--no-html")
    assert every.returncode == 0, every.stderr
    assert every.stdout.count("decisions   ok 9, skip 1") == 2
    assert f"run         {first}" in every.stdout and f"run         {second}" in every.stdout

    unknown = trainguard("report", str(two_runs), "--run", "nope")
    assert unknown.returncode == 2 and unknown.stdout == ""
    lines = unknown.stderr.strip().splitlines()
    assert len(lines) == 1 and f"has no run 'nope'; its runs: {first}, {second}" in lines[0]


@pytest.mark.parametrize(
    ("args", "option", "allowed"),
    [
        (["--ranks", "0"], "--ranks", "from 1 to 32"),
        (["--ranks", "33"], "--ranks", "from 1 to 32"),
        (["--steps", "4"], "--steps", "from 5 to 100000"),
    ],
)
def test_demo_rejects_bad_options_up_front(args: list[str], option: str, allowed: str) -> None:
    done = trainguard("demo", *args, "--run-dir", "/nonexistent/never-written")
    assert done.returncode == 2
    assert done.stdout == ""  # no banner
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"trainguard: demo: {option}: use an integer {allowed}")
