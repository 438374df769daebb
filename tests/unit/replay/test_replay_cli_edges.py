"""Replay edges a user meets at the command line:

- a factory that parses the command line (argparse) or exits when called gets the options
  a script run alone would get, and its exit is a one-line error (exit 2), not trainguard's
  own usage message or a silent exit;
- a factory module that was found but whose own import failed (a missing dependency, a
  syntax error) says so, with the line, and gives no PYTHONPATH advice;
- checking a fix: a step made non-finite by a NaN in its batch, replayed with a loss_fn that
  now handles the NaN, is ``input_handled``, not "the loss does not read them";
- a spike's bundle that does not reproduce speaks of the recorded loss, not of NaNs or a
  transient fault.
"""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import tg_capture_models as models
import torch
from tg_models import TinyNet
from torch import Tensor

import trainguard as tg
from trainguard.cli import EXIT_OK, EXIT_USAGE, main
from trainguard.replay.runner import resolve_factory
from trainguard.replay.verdicts import ADVICE, SPIKE_NOT_REPRODUCED_ADVICE, VERDICTS

pytestmark = pytest.mark.timeout(120)

FACTORIES = "tg_edge_factories"
TRAINGUARD_ARGV = ["trainguard", "replay", "BUNDLE", "--factory", f"{FACTORIES}:make"]

FACTORY_MODULE = """
import argparse
import sys

import torch
from tg_capture_models import ce_loss, clean_factory


class Stop(BaseException):
    pass


def make_opt():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=16)
    parser.parse_args()
    return clean_factory()


def make():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.parse_args()
    return clean_factory()


def exits():
    sys.exit(3)


def stops():
    raise Stop("no model today")


def interrupted():
    raise KeyboardInterrupt


def fixed():
    model, _ = clean_factory()

    def loss_fn(m, batch):
        return ce_loss(m, {**batch, "x": torch.nan_to_num(batch["x"])})

    return model, loss_fn
"""


@pytest.fixture(scope="module")
def factories(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("factories")
    (folder / f"{FACTORIES}.py").write_text(textwrap.dedent(FACTORY_MODULE))
    return folder


@pytest.fixture
def as_trainguard(factories: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The factories importable, and ``sys.argv`` as ``trainguard replay`` has it."""
    monkeypatch.syspath_prepend(str(factories))
    monkeypatch.setattr(sys, "argv", list(TRAINGUARD_ARGV))


@pytest.fixture(scope="module")
def nan_input_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Step 2's batch holds a NaN (sample 5) that the loop's loss reads: loss NaN."""
    run_dir = tmp_path_factory.mktemp("nan_input")
    data = models.batches("inputs", 4, bad_step=2)
    models.train(models.make_model("inputs"), models.ce_loss, data, run_dir)
    return run_dir / "captures" / "step-00000002"


# -- a factory that parses the command line or exits ---------------------------------------


@pytest.mark.usefixtures("as_trainguard")
def test_a_factory_parsing_the_command_line_gets_its_defaults_not_trainguards_options() -> None:
    spec = resolve_factory(f"{FACTORIES}:make_opt")
    assert isinstance(spec.model, torch.nn.Module)
    assert sys.argv == TRAINGUARD_ARGV  # put back after the call


@pytest.mark.usefixtures("as_trainguard")
@pytest.mark.parametrize(
    ("func", "status", "quoted"),
    [("make", 2, "the following arguments are required: --data"), ("exits", 3, None)],
)
def test_a_factory_that_exits_is_a_one_line_error(
    nan_input_bundle: Path,
    capsys: pytest.CaptureFixture[str],
    func: str,
    status: int,
    quoted: str | None,
) -> None:
    argv = ["replay", str(nan_input_bundle), "--factory", f"{FACTORIES}:{func}"]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"calling {FACTORIES}:{func} exited with status {status}" in err
    assert "give those options defaults" in err and "usage:" not in err
    assert "unrecognized arguments" not in err
    if quoted is not None:
        assert f"{FACTORIES}: error: {quoted}" in err  # the script's name, not trainguard's


@pytest.mark.usefixtures("as_trainguard")
def test_a_base_exception_from_the_factory_is_a_replay_error_but_ctrl_c_is_not() -> None:
    with pytest.raises(tg.ReplayError, match="calling tg_edge_factories:stops raised Stop"):
        resolve_factory(f"{FACTORIES}:stops")
    with pytest.raises(KeyboardInterrupt):
        resolve_factory(f"{FACTORIES}:interrupted")


# -- a factory module whose own import fails -----------------------------------------------


def test_a_missing_dependency_of_the_factory_module_is_not_a_pythonpath_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tg_edge_missing_dep.py").write_text(
        "import os\nimport tg_no_such_dependency_xyz\n\n\ndef f():\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tg.ReplayError) as info:
        resolve_factory("tg_edge_missing_dep:f")
    message = str(info.value)
    assert "tg_edge_missing_dep was found, but importing it failed" in message
    assert "No module named 'tg_no_such_dependency_xyz'" in message
    assert "at tg_edge_missing_dep.py:2" in message
    assert "install tg_no_such_dependency_xyz" in message and "PYTHONPATH" not in message


def test_a_syntax_error_in_the_factory_file_names_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tg_edge_syntax.py").write_text("import os\ndef f(:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tg.ReplayError) as info:
        resolve_factory("tg_edge_syntax.py:f")
    message = str(info.value)
    assert "importing it failed (SyntaxError:" in message
    assert "tg_edge_syntax.py:2" in message and "PYTHONPATH" not in message


@pytest.mark.parametrize("factory", ["tg_edge_no_such_module:f", "json.tg_edge_no_such_sub:f"])
def test_a_factory_module_that_is_not_found_gets_the_pythonpath_advice(factory: str) -> None:
    with pytest.raises(tg.ReplayError, match=r"cannot import .*add it to PYTHONPATH"):
        resolve_factory(factory)


# -- checking a fix for a NaN in the batch -------------------------------------------------


@pytest.mark.usefixtures("as_trainguard")
def test_a_loss_fn_that_now_handles_the_batchs_nan_is_a_fix_not_an_input_check_skip(
    nan_input_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tg.replay(nan_input_bundle, f"{FACTORIES}:fixed", repeats=2)
    assert (report.verdict, report.reproduced) == ("input_handled", False)
    assert "input_handled" in VERDICTS and report.advice == ADVICE["input_handled"]
    assert report.details["recorded"]["loss"] == "nan"
    assert "rank 0 recorded loss nan and non-finite gradients" in report.summary
    assert "does not read" not in report.summary and "input check" not in report.summary
    assert "suspect" not in report.summary
    assert [c["position"] for c in report.culprit_samples] == [5]
    argv = ["replay", str(nan_input_bundle), "--factory", f"{FACTORIES}:fixed", "--repeats", "1"]
    assert main(argv) == EXIT_OK  # the fix works: the step no longer reproduces
    assert "verdict        input_handled" in capsys.readouterr().out


# -- a spike that does not reproduce -------------------------------------------------------


def _spike_loss(model: torch.nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, target = batch
    return (model(x) - target).pow(2).mean()


def _spike_run(run_dir: Path, spike_step: int = 12, steps: int = 14) -> Path:
    """A loop whose loss is scaled 50x at ``spike_step`` outside the loss_fn (as a loss
    scaling would be): the spike rule skips and captures it."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = tg.GuardConfig(
        run_dir=run_dir, on_spike="skip", hang_timeout=0, spikes=tg.SpikeConfig(warmup=10)
    )
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 8, generator=gen), torch.ones(6, 4)) for _ in range(steps)]
    with tg.Guard(model, opt, config=config) as guard:
        for step, batch in enumerate(guard.watch(batches)):
            loss = _spike_loss(model, batch) * (50.0 if step == spike_step else 1.0)
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    return run_dir / "captures" / f"step-{spike_step:08d}"


def test_a_spike_that_does_not_reproduce_speaks_of_the_recorded_loss(tmp_path: Path) -> None:
    bundle = _spike_run(tmp_path)
    report = tg.replay(bundle, lambda: (TinyNet(), _spike_loss))
    recorded: Any = report.details["recorded"]["loss"]
    assert report.details["trigger"] == "spike" and math.isfinite(recorded)
    assert (report.verdict, report.reproduced) == ("not_reproduced", False)
    assert report.details["recorded_loss_runs"] == 0
    assert report.advice == SPIKE_NOT_REPRODUCED_ADVICE
    assert "transient fault. If" not in report.advice and "loss scaling" in report.advice
    text = str(report)
    assert f"reproduced     no (0/3 replays reached the recorded loss {recorded:.6g})" in text
    assert "non-finite)" not in text
