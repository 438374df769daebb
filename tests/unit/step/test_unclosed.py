"""A Guard never closed (``step/unclosed.py``): dropped, or still open when an exception
ends the interpreter. Its buffered metrics lines are written, its hooks and threads released,
and a ``close`` event says so (``closed: false``, the ``error`` that ended the run); the
report's ``ended`` line says how the run ended."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.report.summary import summarize
from trainguard.report.text import report_text


def _train(guard: tg.Guard, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for x in guard.watch([torch.randn(2, 4) for _ in range(steps)]):
        loss = model(x).pow(2).mean()
        loss.backward()
        if guard.check(loss):
            opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    "options",
    [{}, {"resume": True}, {"on_escalation": "rollback"}, {"checkpoint_every": 2}],
    ids=["plain", "resume", "rollback", "checkpoints"],
)
def test_a_dropped_guard_is_collected_and_releases_its_hooks(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    """A sweep drops one Guard per trial: nothing may keep it alive (its hooks' closures
    held it before; with recovery, the stream's step counter held it through the release's
    own parts), and its forward hooks come off the model the next trial reuses."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, **options)
    _train(guard, model, opt, 5)
    dropped = weakref.ref(guard)
    del guard
    gc.collect()
    assert dropped() is None
    assert not model._forward_pre_hooks and not model._forward_hooks
    last = json.loads((tmp_path / "events" / "rank-0.jsonl").read_text().splitlines()[-1])
    assert (last["kind"], last["step"], last["closed"]) == ("close", 5, False)
    assert "ended       step 5: the guard was never closed" in report_text(summarize(tmp_path))


def test_an_exception_that_ends_the_interpreter_keeps_the_steps_and_says_why(
    tmp_path: Path,
) -> None:
    """The loop of docs/existing-loop.md (``guard.close()`` after it, no ``finally``) hits
    a bad record at step 30: the 30 steps' metrics lines are written at exit (they were
    lost: "steps 0"), and the report ends with the KeyError."""
    script = textwrap.dedent(
        f"""
        import torch, trainguard as tg
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = [{{"x": torch.randn(2, 4), "y": torch.randn(2, 1)}} for _ in range(40)]
        data[30] = {{"x": torch.randn(2, 4)}}
        guard = tg.Guard(model, opt, run_dir={str(tmp_path)!r}, hang_timeout=0)
        for b in guard.watch(data):
            loss = torch.nn.functional.mse_loss(model(b["x"]), b["y"])
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
        guard.close()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 1 and "KeyError: 'y'" in done.stderr
    lines = (tmp_path / "metrics" / "rank-0.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(30))
    summary = summarize(tmp_path)
    assert summary.steps == 30
    assert "ended       step 30: KeyError: 'y' (ranks [0])" in report_text(summary)


def test_with_guard_records_the_exception_that_ended_it(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0) as guard:
            _train(guard, model, opt, 3)
            raise ValueError("bad metric shape")
    except ValueError:
        pass
    last = json.loads((tmp_path / "events" / "rank-0.jsonl").read_text().splitlines()[-1])
    assert (last["kind"], last["error"]) == ("close", "ValueError: bad metric shape")
    assert "closed" not in last
    assert "ended       step 3: ValueError: bad metric shape" in report_text(summarize(tmp_path))
