"""The command line's edges: a closed stdout pipe, bad ``report`` options and paths, the
demo's cleanup and wording, ``inspect`` of a dataclass batch and of loss-less steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import trainguard as tg
from trainguard.cli import EXIT_FINDING, EXIT_PIPE_CLOSED, EXIT_USAGE, main

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A small run written as JSONL: 10 steps, a NaN loss at step 3, closed."""
    folder = tmp_path / "run"
    events = [
        {"time": 1.0, "rank": 0, "step": 0, "kind": "start", "run": "r1", "world_size": 1},
        {"time": 2.0, "rank": 0, "step": 3, "kind": "nonfinite", "run": "r1", "where": "loss",
         "ranks": [0], "action": "skip"},
        {"time": 3.0, "rank": 0, "step": 10, "kind": "close", "run": "r1"},
    ]  # fmt: skip
    metrics = [
        {"step": s, "losses": ["nan" if s == 3 else 1.0], "grad_norm": 0.5,
         "decision": "skip" if s == 3 else "ok", "time": 1.5 + s / 100}
        for s in range(10)
    ]  # fmt: skip
    for name, lines in (("events", events), ("metrics", metrics)):
        (folder / name).mkdir(parents=True)
        text = "".join(json.dumps(line) + "\n" for line in lines)
        (folder / name / "rank-0.jsonl").write_text(text, encoding="utf-8")
    return folder


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_a_closed_stdout_pipe_ends_quietly(run_dir: Path) -> None:
    """``trainguard report RUN | true``: no "[Errno 32] Broken pipe", no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    cmd = [sys.executable, "-m", "trainguard", "report", str(run_dir), "--no-html"]
    try:
        done = subprocess.run(cmd, stdout=write_end, stderr=subprocess.PIPE, timeout=100)
    finally:
        os.close(write_end)
    assert done.stderr.decode() == ""
    assert done.returncode == EXIT_PIPE_CLOSED


@pytest.mark.parametrize("where", ["directory", "below a file"])
def test_an_unwritable_png_names_the_option(
    where: str, run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file.png").write_text("")
    png = tmp_path if where == "directory" else tmp_path / "file.png" / "x.png"
    assert main(["report", str(run_dir), "--no-html", "--png", str(png)]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert "first bad   step 3" in out  # the summary is still printed
    line = _one_line(err)
    assert line.startswith(f"trainguard: report: --png {png}: cannot write the picture")
    reason = "it is a directory" if where == "directory" else f"{tmp_path / 'file.png'} is a file"
    assert reason in line and "give a file path" in line
    assert "Errno" not in line


def test_a_file_is_not_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["report", str(script)]) == EXIT_USAGE
    line = _one_line(capsys.readouterr().err)
    assert f"{script} is a file, not a run directory" in line
    assert "no such directory" not in line


@pytest.mark.parametrize("extra", [["--png", "t.png"], ["--run", "r1"], ["--run", "all"]])
def test_runs_refuses_png_and_run(
    extra: list[str], run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(run_dir), "--runs", *extra]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == ""
    assert f"drop {extra[0]}" in _one_line(err)
    assert not (run_dir / "t.png").exists()


def test_the_demo_clears_what_a_previous_demo_left(tmp_path: Path) -> None:
    from trainguard.demo import _clear

    for folder in ("events", "metrics", "captures", "hangs", "recovery"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "rank-0.jsonl").write_text("{}\n")
    for name in ("launch.log", "report.html", "stop.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "mine").mkdir()
    _clear(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "notes.txt"]


def test_demo_with_one_rank_says_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import trainguard.demo as demo

    def fail(*args: Any, **kwargs: Any) -> None:
        raise demo.DemoError("stopped by the test")

    monkeypatch.setattr(demo, "run_demo", fail)
    args = ["demo", "--ranks", "1", "--steps", "5", "--run-dir", str(tmp_path)]
    assert main(args) == EXIT_FINDING
    assert capsys.readouterr().out.startswith("trainguard demo: 1 rank on CPU (gloo, DDP)")


@dataclass
class Pair:
    x: Tensor
    y: Tensor


def _bundle(run_dir: Path, batches: list[Any], step_fn: Any) -> Path:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0) as guard:
        for batch in guard.watch(batches):
            if step_fn(guard, model, batch):
                opt.step()
            opt.zero_grad()
    (bundle,) = (run_dir / "captures").glob("step-*")
    return bundle


def _pair_step(guard: tg.Guard, model: nn.Module, batch: Pair) -> bool:
    loss = (model(batch.x) - batch.y).pow(2).mean()
    loss.backward()
    return guard.check(loss)


def test_inspect_names_a_dataclass_batch_by_its_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = [Pair(torch.randn(3, 4), torch.randn(3, 1)) for _ in range(3)]
    pairs[2].x[0, 0] = float("nan")
    bundle = _bundle(tmp_path, pairs, _pair_step)
    assert main(["inspect", str(bundle)]) == 0
    assert "  batch: Pair, 3 samples" in capsys.readouterr().out
    assert main(["inspect", str(bundle), "--json"]) == 0
    (batch,) = json.loads(capsys.readouterr().out)["per_rank"][0]["batch"]
    assert batch["type"] == "Pair" and batch["stored_type"].endswith(":Pair")


def _gradients_only(guard: tg.Guard, model: nn.Module, x: Tensor) -> bool:
    """``trainguard run``'s check: the gradients, no loss."""
    (model(x) - 1.0).pow(2).mean().backward()
    return guard.check_gradients()


def test_inspect_history_says_loss_not_seen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    xs = [torch.randn(3, 4) for _ in range(3)]
    xs[2][0, 0] = float("nan")
    bundle = _bundle(tmp_path, xs, _gradients_only)
    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    history = [line for line in out.splitlines() if line.startswith(("history", "  step"))]
    assert len(history) == 4, out
    assert all("loss not seen, grad norm" in line for line in history), history
    assert "loss ," not in out
    assert main(["inspect", str(bundle), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)["history"]["last_records"]
    assert [r["losses"] for r in records] == [[], [], []]  # the JSON keeps the records
