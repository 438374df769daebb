"""Two open Guards of one process in one run dir are told apart or warned about (runs/dirs.py)."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.runs.dirs import open_runs

WARNING = "is also the run dir of another open Guard in this process"


def _guard(run_dir: Path) -> tg.Guard:
    model = nn.Linear(2, 1)
    return tg.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=run_dir)


def test_a_second_open_guard_in_the_same_run_dir_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trainguard")
    actor = _guard(tmp_path)
    assert WARNING not in caplog.text
    critic = _guard(tmp_path)
    assert WARNING in caplog.text and f"{tmp_path}/<model>" in caplog.text
    assert len(open_runs(tmp_path)) == 2
    critic.close()
    actor.close()
    assert open_runs(tmp_path) == []
    caplog.clear()
    _guard(tmp_path).close()  # one at a time: nothing to say
    _guard(tmp_path / "actor").close()
    assert WARNING not in caplog.text


def test_a_guard_dropped_without_close_releases_its_run_dir(tmp_path: Path) -> None:
    gc.freeze()  # the collection below scans the guard's objects, not the whole session's
    try:
        guard = _guard(tmp_path)
        assert len(open_runs(tmp_path)) == 1

        del guard
        gc.collect()
        assert open_runs(tmp_path) == []
    finally:
        gc.unfreeze()
