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
def test_runs_lists_them_and_run_picks_one_or_all(
    two_runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process (``cli.main``): the command's own path, without a Python start per call
    (the test above runs the real command)."""
    from trainguard.cli import main

    def report(*args: str) -> tuple[int, str, str]:
        code = main(["report", str(two_runs), *args])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = report("--runs", "--json")
    assert code == 0, err
    data = json.loads(out)
    first, second = (r["id"] for r in data["runs"])
    assert first < second and data["latest"] == second
    assert [r["steps"] for r in data["runs"]] == [10, 10]
    text = report("--runs")[1]
    assert first in text and f"{second} " in text and "(latest: shown by default)" in text

    chosen = json.loads(report("--run", first, "--json")[1])
    assert chosen["run"] == first and chosen["decisions"] == {"ok": 9, "skip": 1}
    assert [r["id"] for r in chosen["runs"]] == [first, second]

    code, out, err = report("--run", "all", "--no-html")
    assert code == 0, err
    assert out.count("decisions   ok 9, skip 1") == 2
    assert f"run         {first}" in out and f"run         {second}" in out

    code, out, err = report("--run", "nope")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"has no run 'nope'; its runs: {first}, {second}" in lines[0]


@pytest.mark.parametrize(
    ("args", "option", "allowed"),
    [
        (["--ranks", "0"], "--ranks", "from 1 to 32"),
        (["--ranks", "33"], "--ranks", "from 1 to 32"),
        (["--steps", "4"], "--steps", "from 5 to 100000"),
    ],
)
def test_demo_rejects_bad_options_up_front(
    args: list[str], option: str, allowed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainguard.cli import main  # in process: the check comes before any launch

    code = main(["demo", *args, "--run-dir", "/nonexistent/never-written"])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""  # no banner
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"trainguard: demo: {option}: use an integer {allowed}")
