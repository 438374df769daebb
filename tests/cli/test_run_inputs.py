"""``trainguard run --ignore-inputs`` / ``--no-check-inputs`` / ``--[no-]allow-masks``: a
script whose model takes an additive -inf mask as an input trains through, the rest of its
inputs still checked; by default the mask is found at the first step and left out; with
``--no-allow-masks`` its steps are skipped until the guard stops it, and the message names
the flag."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from trainguard.attach.options import RunOptions
from trainguard.cli import main
from trainguard.errors import ConfigError

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "run_scripts" / "additive_mask.py"
TRAIN = SCRIPT.with_name("train_ddp.py")


def _kinds(run_dir: Path) -> list[str]:
    lines = (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()
    return [json.loads(line)["kind"] for line in lines]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [["--ignore-inputs", "[1]"], ["--no-check-inputs"]])
def test_a_mask_input_left_out_trains_through(tmp_path: Path, flags: list[str]) -> None:
    command = [sys.executable, str(SCRIPT)]
    assert main(["run", "--run-dir", str(tmp_path), *flags, "--", *command]) == 0
    kinds = _kinds(tmp_path)
    assert "start" in kinds and "bad_input" not in kinds and "nonfinite" not in kinds


@pytest.mark.timeout(120)
def test_without_them_the_mask_is_found_and_left_out(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``allow_masks`` (on by default): the first step finds the input holding only 0 and -inf
    at a finite step, says so once naming the flag, and leaves it out; no step is skipped."""
    command = [sys.executable, str(SCRIPT)]
    assert main(["run", "--run-dir", str(tmp_path), "--", *command]) == 0
    err = capfd.readouterr().err
    assert err.count("taken for an additive mask") == 1 and "--ignore-inputs '[1]'" in err
    kinds = _kinds(tmp_path)
    assert kinds.count("input_mask") == 1 and "bad_input" not in kinds and "skip" not in kinds


@pytest.mark.timeout(120)
def test_with_no_allow_masks_the_guard_stops_the_script_naming_the_flag(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    command = [sys.executable, str(SCRIPT)]
    run = ["run", "--run-dir", str(tmp_path), "--no-allow-masks", "--", *command]
    assert main(run) == 1  # NonFiniteError
    err = capfd.readouterr().err
    assert "--ignore-inputs '[1]'" in err  # the entry's own path, quoted for the shell
    assert _kinds(tmp_path).count("bad_input") == 5  # max_consecutive, then the stop


def test_the_input_options_reach_the_workers_as_json() -> None:
    options = RunOptions(check_inputs=False, ignore_inputs=("mask", "[1]"), allow_masks=False)
    assert RunOptions.from_mapping(json.loads(options.to_json())) == options
    with pytest.raises(ConfigError, match=r"inputs\.ignore"):
        RunOptions(ignore_inputs="mask")  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_a_bad_sample_in_the_first_step_is_named_by_its_dataset_index(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The guard attaches at the first optimizer step, after that step's forward: the
    loader's draws of that forward (recorded before any guard existed) name its bad sample
    as a later step's are named, in the event, the bundle and the message."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    command = [sys.executable, str(TRAIN), "--out", str(out), "--nan-rank", "0", "--nan-step", "0"]
    assert main(["run", "--run-dir", str(run_dir), "--", *command]) == 0
    assert "non-finite input at [0], samples [0] (dataset indices [0])" in capfd.readouterr().err
    lines = (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()
    (bad,) = [event for line in lines if (event := json.loads(line))["kind"] == "bad_input"]
    assert bad["step"] == 0
    assert [(t["positions"], t["dataset_indices"]) for t in bad["tensors"]] == [([0], [0])]
    meta = json.loads((run_dir / "captures" / "step-00000000" / "rank-0" / "meta.json").read_text())
    assert meta["dataset_indices"] == [[0, 1, 2, 3]]
