"""A run's identity in its run_dir: the rule (new, torchrun restart, resume), its id on every
event and in capture manifests, and a capture's "first" label per run."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_models import TinyNet, loss_fn, make_batches

import trainguard as tg
from trainguard.events import read_events
from trainguard.runs.identity import (
    CONTINUE,
    NEW,
    continues,
    decide_run,
    latest_run,
    new_run_id,
)


def _train(run_dir: Path, steps: int = 6, bad: int | None = None, **options: Any) -> tg.Guard:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if "config" not in options:
        options = {"run_dir": run_dir, "hang_timeout": 0, **options}
    with tg.Guard(model, opt, **options) as guard:
        for batch in guard.watch(make_batches(steps, seed=1)):
            loss = loss_fn(model, batch)
            if guard.state.step == bad:
                loss = loss * float("nan")
            loss.backward()
            guard.step(loss)
    return guard


def _runs(run_dir: Path) -> list[str]:
    """The run of each rank-0 ``start`` event, in order."""
    return [e["run"] for e in read_events(run_dir, rank=0) if e["kind"] == "start"]


def test_the_rule_new_restart_resume() -> None:
    assert continues(False, None, {}) is None
    assert continues(False, None, {"TORCHELASTIC_RESTART_COUNT": "0"}) is None
    assert continues(False, None, {"TORCHELASTIC_RESTART_COUNT": "2"}) == "restart"
    assert continues(True, None, {}) == "resume"
    assert continues(False, CONTINUE, {}) == "resume"  # an integration resuming
    assert continues(True, NEW, {"TORCHELASTIC_RESTART_COUNT": "1"}) is None  # forced new
    assert continues(False, "20260101-000000-abcd", {}) == "given"


def test_new_ids_sort_by_start_time() -> None:
    early = new_run_id(datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc))
    late = new_run_id(datetime(2026, 11, 2, 3, 4, 5, tzinfo=timezone.utc))
    assert early.startswith("20260102-030405-") and len(early) == len("20260102-030405-abcd")
    assert early < late


def test_latest_run_reads_the_tail_and_skips_a_torn_line(tmp_path: Path) -> None:
    assert latest_run(tmp_path) is None
    events = tmp_path / "events" / "rank-0.jsonl"
    events.parent.mkdir()
    events.write_text('{"kind": "start", "step": 0}\n')  # a legacy log: no run ids
    assert latest_run(tmp_path) is None
    assert decide_run(tmp_path, True, None, {}).origin == NEW  # nothing to continue
    with events.open("a") as fh:
        fh.write('{"kind": "start", "run": "a"}\n{"kind": "close", "run": "b"}\n{"kind": "sk')
    assert latest_run(tmp_path) == "b"
    assert decide_run(tmp_path, False, None, {"TORCHELASTIC_RESTART_COUNT": "1"}).id == "b"


def test_a_run_again_in_the_same_dir_is_a_new_run(tmp_path: Path) -> None:
    _train(tmp_path)
    _train(tmp_path)
    first, second = _runs(tmp_path)
    assert first != second
    for event in read_events(tmp_path):
        assert event["run"] in (first, second)
    starts = [e for e in read_events(tmp_path) if e["kind"] == "start"]
    assert [e["run_origin"] for e in starts] == ["new", "new"]


def test_torchrun_restart_and_resume_continue_the_latest_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _train(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _train(tmp_path)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    _train(tmp_path, resume=True)
    _train(tmp_path)
    runs = _runs(tmp_path)
    assert runs[0] == runs[1] == runs[2] != runs[3]
    origins = [e["run_origin"] for e in read_events(tmp_path, rank=0) if e["kind"] == "start"]
    assert origins == ["new", "restart", "resume", "new"]


def test_the_run_option(tmp_path: Path) -> None:
    with pytest.raises(tg.ConfigError, match=r"^run: "):
        tg.GuardConfig(run="no spaces please")
    _train(tmp_path, config=tg.GuardConfig(run_dir=tmp_path, run="mine", hang_timeout=0))
    _train(tmp_path, config=tg.GuardConfig(run_dir=tmp_path, run=CONTINUE, hang_timeout=0))
    assert _runs(tmp_path) == ["mine", "mine"]
    _train(tmp_path, run=CONTINUE)  # the Guard argument, as a loop resuming its own checkpoint
    _train(tmp_path, run="new")
    runs = _runs(tmp_path)
    assert runs[:3] == ["mine"] * 3 and runs[3] != "mine"


def test_first_bad_step_is_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _train(tmp_path, bad=2)
    _train(tmp_path, bad=3)  # a new run: its own first bad step
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _train(tmp_path, bad=4)  # a restart of that run: not its first any more
    manifests = [
        json.loads(p.read_text()) for p in sorted((tmp_path / "captures").glob("*/manifest.json"))
    ]
    got = sorted((m["step"], m["reason"], m["run"]) for m in manifests)
    first, second = dict.fromkeys(_runs(tmp_path))
    assert got == [
        (2, "first_bad_step", first),
        (3, "first_bad_step", second),
        (4, "first_bad_step_after_restart", second),
    ]
    captures = [e for e in read_events(tmp_path) if e["kind"] == "capture"]
    assert [e["reason"] for e in captures][-1] == "first_bad_step_after_restart"


def test_the_stop_record_names_its_run(tmp_path: Path) -> None:
    _train(tmp_path)  # an earlier run in the same dir
    with pytest.raises(tg.NonFiniteError):
        _train(tmp_path, bad=2, max_consecutive=1)  # the first bad step escalates: a stop
    record = json.loads((tmp_path / "stop.json").read_text())
    assert record["run"] == _runs(tmp_path)[-1] != _runs(tmp_path)[0]
