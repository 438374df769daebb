"""`trainguard inspect`, `replay` and `demo`: output, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tg_capture_models as models

from trainguard.cli import EXIT_FINDING, EXIT_OK, EXIT_USAGE, main
from trainguard.replay.runner import KEYS

pytestmark = pytest.mark.timeout(60)

SUPPORT = Path(__file__).parents[1] / "support"
TRAINGUARD = Path(sys.executable).with_name("trainguard")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    data = models.batches("forward", 4, bad_step=2)
    models.train(models.make_model("forward"), models.ce_loss, data, run_dir)
    return run_dir / "captures" / "step-00000002"


def test_inspect_text(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(bundle)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "step 2: non-finite loss on ranks [0]" in out
    assert "['x']" in out and "float32" in out and "[8, 6]" in out
    assert "dataset indices 1016..1023" in out
    assert "non-finite gradients: encoder.layers.0.fc.weight" in out


def test_inspect_json(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(bundle), "--json"]) == EXIT_OK
    summary = json.loads(capsys.readouterr().out)
    assert (summary["step"], summary["trigger"], summary["ranks"]) == (2, "loss", [0])
    (rank,) = summary["per_rank"]
    assert rank["loss"] == "nan" and rank["files"]["model.pt"] > 0
    leaves = {leaf["path"]: leaf for leaf in rank["batch"][0]["leaves"]}
    assert leaves["['x']"]["shape"] == [8, 6] and leaves["['x']"]["nan"] == 0
    assert leaves["['y']"]["dtype"] == "int64" and leaves["['y']"]["max"] == 2


def test_replay_json_is_one_object(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["replay", str(bundle), "--factory", "tg_capture_models:forward_factory", "--json"])
    assert code == EXIT_FINDING  # reproduced: a finding
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    report = json.loads(out)
    assert list(report)[: len(KEYS)] == list(KEYS)
    assert (report["phase"], report["op"], report["module"]) == (
        "forward",
        "aten.div",
        "encoder.layers.0.norm",
    )


def test_replay_text(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["replay", str(bundle), "--factory", "tg_capture_models:forward_factory"]
    assert main([*args, "--repeats", "2"]) == EXIT_FINDING
    out = capsys.readouterr().out
    assert "phase          forward" in out and "module         encoder.layers.0.norm" in out
    assert "culprits       5 (index 1021)" in out


def test_only_the_bundles_own_diagnosis_is_kept_for_the_report(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A replay with --rank or --autocast (a look at another rank or precision) does not
    replace the kept diagnosis (replay.json) that `trainguard report` shows."""
    kept = bundle / "replay.json"
    args = ["replay", str(bundle), "--factory", "tg_capture_models:forward_factory"]
    assert main([*args, "--repeats", "1"]) == EXIT_FINDING
    before = kept.read_text()
    main([*args, "--repeats", "1", "--rank", "0", "--autocast", "off"])
    main([*args, "--repeats", "1", "--autocast", "bfloat16"])
    capsys.readouterr()
    assert kept.read_text() == before


def test_replay_not_reproduced_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainguard.testing import Fault, FaultPlan

    plan = FaultPlan([Fault(step=1, where="grad")])
    data = models.batches("clean", 3, bad_step=-1)
    models.train(models.make_model("clean"), models.ce_loss, data, tmp_path, plan=plan)
    path = tmp_path / "captures" / "step-00000001"
    assert main(["replay", str(path), "--factory", "tg_capture_models:clean_factory"]) == EXIT_OK
    assert "verdict        not_reproduced" in capsys.readouterr().out


def _damaged(bundle: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(bundle, copy)
    (copy / "manifest.json").write_text('{"format": "trainguard-capture", "version": 1,')
    return copy


BAD_INPUTS = {
    "missing path": (["inspect", "{tmp}/nope"], "no such file or folder"),
    "not a bundle": (["inspect", "{tmp}"], "not a capture bundle"),
    "damaged manifest": (["inspect", "{damaged}"], "damaged manifest"),
    "replay missing path": (["replay", "{tmp}/nope", "--factory", "a:b"], "no such file"),
    "factory without colon": (["replay", "{bundle}", "--factory", "nocolon"], "MODULE:FUNC"),
    "factory not importable": (["replay", "{bundle}", "--factory", "nosuchmod:f"], "cannot import"),
    "factory wrong return": (
        ["replay", "{bundle}", "--factory", "tg_capture_models:wrong_return_factory"],
        "must return (model, loss_fn)",
    ),
    "factory raises": (
        ["replay", "{bundle}", "--factory", "tg_capture_models:raising_factory"],
        "raised RuntimeError",
    ),
    "weights do not fit": (
        ["replay", "{bundle}", "--factory", "tg_capture_models:wrong_model_factory"],
        "do not fit the factory's model",
    ),
    "bad rank": (
        ["replay", "{bundle}", "--factory", "tg_capture_models:forward_factory", "--rank", "3"],
        "--rank 3",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(
    case: str, bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, message = BAD_INPUTS[case]
    fill = {"tmp": str(tmp_path), "bundle": str(bundle), "damaged": str(_damaged(bundle, tmp_path))}
    assert main([a.format(**fill) for a in argv]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: ") and message in lines[0]


KILLED_MID_WRITE = textwrap.dedent(
    """
    import io, os, sys
    import torch
    sys.path.insert(0, {support!r})
    import tg_capture_models as models
    from trainguard.step import capturer as capture

    real = capture.write_torch
    def write(path, obj):
        if path.name == "model.pt":  # killed halfway through the weights
            data = io.BytesIO()
            torch.save(obj, data)
            path.write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
            os._exit(9)
        return real(path, obj)
    capture.write_torch = write
    data = models.batches("forward", 3, bad_step=1)
    models.train(models.make_model("forward"), models.ce_loss, data, {run_dir!r})
    """
)


def test_capture_killed_mid_write_is_not_a_bundle(tmp_path: Path) -> None:
    script = KILLED_MID_WRITE.format(support=str(SUPPORT), run_dir=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    (partial,) = (tmp_path / "captures").iterdir()
    assert partial.name.startswith(".tmp-") and not list(tmp_path.glob("captures/step-*"))
    result = subprocess.run(
        [str(TRAINGUARD), "inspect", str(partial)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == EXIT_USAGE and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "incomplete capture" in result.stderr
    assert "Traceback" not in result.stderr


def test_real_entry_point_bad_factory(bundle: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SUPPORT))
    result = subprocess.run(
        [str(TRAINGUARD), "replay", str(bundle), "--factory", "tg_capture_models:nope"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == EXIT_USAGE and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(180)
def test_demo_prints_the_diagnosis(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(TRAINGUARD), "demo", "--steps", "15", "--run-dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "step   6: non-finite loss on rank(s) [1] -> every rank skips it" in out
    assert "phase          loss" in out and "op             aten.div" in out
    assert "verdict        batch_statistics" in out and "no single sample is to blame" in out
    assert "no sample of class 3" in out
    assert list((tmp_path / "demo" / "captures").glob("step-00000006"))
