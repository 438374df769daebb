"""``trainguard report`` on real runs: the demo (2 ranks, a NaN step, replayed) and a hang."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_dist import run_ranks
from tg_models import TinyNet, loss_fn, make_batches

import trainguard as tg


def trainguard(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "trainguard", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's run dir (a real 2-rank DDP run with torchrun, captured and replayed)."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    done = trainguard("demo", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    return run_dir


def _stalling(rank: int) -> Any:
    for index, batch in enumerate(make_batches(50, seed=rank)):
        if rank == 1 and index == 4:
            threading.Event().wait()  # stuck in the data loader
        yield batch


def _train_until_hang(rank: int, world: int, run_dir: str) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tg.Guard(model, opt, run_dir=run_dir, hang_timeout=2.0) as guard:
        for batch in guard.watch(_stalling(rank)):
            loss = loss_fn(model, batch)
            loss.backward()
            guard.step(loss)


@pytest.fixture(scope="module")
def hang_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-rank run whose rank 1 gets stuck in its data loader at step 4."""
    run_dir = tmp_path_factory.mktemp("hang")
    results = run_ranks(_train_until_hang, 2, str(run_dir), timeout=60)
    assert [r.exitcode for r in results] == [tg.EXIT_HANG] * 2
    return run_dir


@pytest.mark.timeout(150)
def test_report_on_the_demo_run(demo_run: Path, tmp_path: Path) -> None:
    png = tmp_path / "timeline.png"
    done = trainguard("report", str(demo_run), "--png", str(png))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "steps       30 (2 ranks); 30 in the metrics log" in out
    assert "decisions   ok 29, skip 1" in out
    assert "first bad   step 12: non-finite loss on ranks [1] (skip)" in out
    assert "diagnosis: aten.div" in out  # the demo's replay result, kept beside the bundle
    page = (demo_run / "report.html").read_text(encoding="utf-8")
    assert "http://" not in page and "https://" not in page  # self-contained
    assert "data:image/png;base64," in page
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.timeout(150)
def test_report_json_of_the_demo_run(demo_run: Path) -> None:
    done = trainguard("report", str(demo_run), "--json", "--no-html")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["steps"] == 30 and data["world_size"] == 2
    assert data["first_bad"]["ranks"] == [1] and data["metric_steps"] == 30
    assert [c["step"] for c in data["captures"]] == [12] and data["captures"][0]["reproduced"]
    assert data["page"] is None


@pytest.mark.timeout(150)
def test_report_on_a_hang_names_the_culprit(hang_run: Path) -> None:
    done = trainguard("report", str(hang_run), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [(h["kind"], h["culprits"]) for h in data["hangs"]] == [("hang", [1])]
    assert data["world_size"] == 2 and data["decisions"] == {"ok": data["steps"]}
    text = trainguard("report", str(hang_run), "--no-html").stdout
    assert "hangs       step 3: hang, culprit ranks [1]" in text  # rank 1 never got past 3


NO_TORCH = (
    "import sys\n"
    "from trainguard.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "assert 'torch' not in sys.modules, 'trainguard report imported torch'\n"
    "raise SystemExit(code)\n"
)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("options", [(), ("--json",), ("--no-html",)])
def test_report_reads_a_capture_and_a_hang_without_importing_torch(
    demo_run: Path, hang_run: Path, options: tuple[str, ...]
) -> None:
    """A report is JSON read back: it must not pay torch's import (2 s here) on a login node.
    The demo run holds a capture and its replay, the hang run a hang's stacks; the output is
    the same as the command's."""
    for run_dir in (demo_run, hang_run):
        args = ["report", str(run_dir), *options]
        done = subprocess.run(
            [sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == trainguard(*args).stdout


@pytest.mark.timeout(150)
def test_corrupt_events_are_skipped_and_said(demo_run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(demo_run, copy)
    events = copy / "events" / "rank-1.jsonl"
    text = events.read_text(encoding="utf-8")
    events.write_text("not json at all\n" + text + '{"time": 17000, "kind": "clo', encoding="utf-8")
    done = trainguard("report", str(copy))
    assert done.returncode == 0, done.stderr
    assert "unreadable  events/rank-1.jsonl: 2 unreadable lines" in done.stdout
    assert "first bad   step 12" in done.stdout


def test_missing_or_foreign_directory_exits_2_with_one_line(tmp_path: Path) -> None:
    missing = trainguard("report", str(tmp_path / "nope"))
    (tmp_path / "README.txt").write_text("not a run")
    foreign = trainguard("report", str(tmp_path))
    for done in (missing, foreign):
        assert done.returncode == 2 and done.stdout == ""
        assert len(done.stderr.strip().splitlines()) == 1
    assert "no such directory" in missing.stderr
    assert "nothing to report" in foreign.stderr
    assert not (tmp_path / "report.html").exists()


def _load_screenshot_script() -> Any:
    import importlib.util

    path = Path(__file__).parents[2] / "benchmarks" / "screenshot_report.py"
    spec = importlib.util.spec_from_file_location("screenshot_report", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(150)
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium")
def test_page_renders_in_headless_chromium(demo_run: Path, tmp_path: Path) -> None:
    from matplotlib.image import imread

    assert trainguard("report", str(demo_run)).returncode == 0
    shot = _load_screenshot_script().screenshot(demo_run / "report.html", tmp_path / "shot.png")
    pixels = imread(str(shot))
    assert pixels.shape[:2] == (900, 1200)
    red = (abs(pixels[..., 0] - 0xD6 / 255) < 0.03) & (abs(pixels[..., 1] - 0x27 / 255) < 0.03)
    assert red.sum() > 50  # the non-finite marker and the rank x step cell were drawn
