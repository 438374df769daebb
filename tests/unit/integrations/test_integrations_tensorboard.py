"""TensorBoard: guard.metrics() as scalars and the notable events as text, read back with
TensorBoard's own EventAccumulator; the event listener of the EventLog."""

from __future__ import annotations

import importlib.util
import logging
import math
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tensorboard")

import torch
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)
from tensorboard.util import tensor_util
from torch import nn

import trainguard as tg
from trainguard.events import EventLog
from trainguard.integrations.tensorboard import TensorBoardLogger, summary_writer

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tensorboard_metrics.py"
TEXT = "trainguard/events/text_summary"  # add_text's tag, as SummaryWriter stores it


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("tg_tensorboard_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(log_dir: Path) -> EventAccumulator:
    if not list(log_dir.glob("events.out.*")):  # the default: a directory per trainguard run
        (log_dir,) = [d for d in log_dir.iterdir() if d.is_dir()]
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _texts(acc: EventAccumulator) -> list[tuple[int, str]]:
    return [
        (ev.step, tensor_util.make_ndarray(ev.tensor_proto).item().decode())
        for ev in acc.Tensors(TEXT)
    ]


def test_the_example_writes_the_skip_as_a_scalar_and_as_text(tmp_path: Path) -> None:
    ex = _example()
    ex.train(tmp_path)
    acc = _read(tmp_path / "tensorboard")
    skipped = [(s.step, s.value) for s in acc.Scalars("trainguard/skipped_steps")]
    assert skipped == [(i, 0.0 if i < ex.POISONED else 1.0) for i in range(12)]
    assert {"train/loss", "trainguard/loss", "trainguard/grad_norm"} <= set(acc.Tags()["scalars"])
    assert math.isnan(acc.Scalars("trainguard/loss")[ex.POISONED].value)
    texts = _texts(acc)
    kinds = [text.split("**")[1] for _, text in texts]
    assert kinds == ["bad_input", "nonfinite", "capture", "skip"]
    assert all(step == ex.POISONED for step, _ in texts)
    assert "at step 5 (rank 0)" in texts[3][1] and '"consecutive": 1' in texts[3][1]


def test_an_event_from_another_thread_is_on_disk_at_once(tmp_path: Path) -> None:
    """A hang's event comes from the watchdog's thread just before os._exit: no close."""
    model = nn.Linear(2, 1)
    guard = tg.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path, hang_timeout=0
    )
    tb = TensorBoardLogger(guard)  # its own writer, under run_dir/tensorboard
    watchdog = threading.Thread(
        target=guard.events.write, args=("hang", 3), kwargs={"culprits": [1], "exit_code": 91}
    )
    watchdog.start()
    watchdog.join()
    texts = _texts(_read(tmp_path / "tensorboard"))  # read before anything is closed
    assert texts == [(3, '**hang** at step 3 (rank 0): `{"culprits": [1], "exit_code": 91}`')]
    guard.events.write("phase", 3, phase="eval")  # not a notable kind: not written
    tb.close()
    guard.close()
    guard.events.write("skip", 4)  # after close: no longer listening
    assert len(_texts(_read(tmp_path / "tensorboard"))) == 1


def test_a_shared_writer_stays_open(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    guard = tg.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path, hang_timeout=0
    )
    writer = summary_writer(tmp_path / "tb")
    with TensorBoardLogger(guard, writer) as tb:
        tb.log()  # before any step: at step -1
    writer.add_scalar("mine", 1.0, 0)  # still usable
    writer.close()
    guard.close()
    acc = _read(tmp_path / "tb")
    assert [s.step for s in acc.Scalars("trainguard/step")] == [-1]
    assert acc.Scalars("mine")[0].value == 1.0


def test_a_failing_listener_is_logged_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = EventLog(tmp_path, 0)
    seen: list[str] = []

    def broken(record: dict[str, Any]) -> None:
        raise RuntimeError("listener bug")

    log.add_listener(broken)
    log.add_listener(lambda record: seen.append(record["kind"]))
    with caplog.at_level(logging.ERROR, logger="trainguard.events"):
        record = log.write("skip", 1, consecutive=1)
    assert record["kind"] == "skip" and seen == ["skip"]
    assert "listener" in caplog.text and "listener bug" in caplog.text
    log.remove_listener(broken)
    log.remove_listener(broken)  # not there any more: no error
    log.write("skip", 2)
    log.close()
    assert seen == ["skip", "skip"]
    assert len(tg.read_events(tmp_path, 0)) == 2


def test_importing_the_module_imports_no_tensorboard() -> None:
    code = (
        "import sys, trainguard, trainguard.integrations.tensorboard; "
        "assert not {'tensorboard', 'torch.utils.tensorboard'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _rolling_back_guard(tmp_path: Path) -> tuple[nn.Module, torch.optim.Optimizer, tg.Guard]:
    """A small model whose guard rolls back after two bad steps in a row."""
    config = tg.GuardConfig(
        run_dir=tmp_path,
        on_escalation="rollback",
        max_consecutive=2,
        hang_timeout=0,
        capture=False,
        recovery=tg.RecoveryConfig(snapshot_every=2, good_after=2),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, opt, tg.Guard(model, opt, config=config)


def test_after_a_rollback_events_stay_beside_the_loops_scalars(tmp_path: Path) -> None:
    """A rollback sends the guard's step back; the loop's counter goes on and ``log(i)``
    writes the scalars there. Each skip and the rollback are written where their scalar
    moved, not at the guard's (lower) step."""
    from tg_recovery import make_data

    model, opt, guard = _rolling_back_guard(tmp_path)
    tb = TensorBoardLogger(guard)
    ruined = 0
    for i, (x, y, scale) in enumerate(guard.watch(make_data(0, 20, {5: 1e37, 9: 1e37}))):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if guard.check(loss):
            if scale != 1.0 and ruined < 2:  # a second ruin after the first rollback
                ruined += 1
                for p in model.parameters():
                    p.grad.fill_(scale)  # type: ignore[union-attr]
            opt.step()
        opt.zero_grad(set_to_none=True)
        tb.log(i)
    tb.close()
    guard.close()
    acc = _read(tmp_path / "tensorboard")

    def moved(tag: str) -> list[int]:
        values = [(s.step, s.value) for s in acc.Scalars(tag)]
        return [s for (s, v), (_, before) in zip(values[1:], values, strict=False) if v > before]

    texts = _texts(acc)
    kinds_at = {
        kind: [s for s, t in texts if t.startswith(f"**{kind}**")] for kind in ("skip", "rollback")
    }
    assert kinds_at["rollback"] == moved("trainguard/rollbacks") and kinds_at["rollback"]
    assert kinds_at["skip"] == [
        s for s in moved("trainguard/skipped_steps") if s not in kinds_at["rollback"]
    ]
    assert len(kinds_at["rollback"]) == 2
    assert any(f"at step {s} " not in t for s, t in texts)  # the text keeps the guard's step


def test_log_without_a_step_writes_an_axis_that_only_goes_forward(tmp_path: Path) -> None:
    """``log()`` with no step: at the step the numbers describe, plus the steps the rollbacks
    made the run take again. The escalating step's numbers go at that step; the steps taken
    again after it follow it, not go back (issue 53: steps 20-31 were drawn twice)."""
    from tg_recovery import make_data

    model, opt, guard = _rolling_back_guard(tmp_path)
    tb = TensorBoardLogger(guard)
    for x, y, _ in guard.watch(make_data(0, 14, {5: math.nan, 6: math.nan})):
        loss = nn.functional.mse_loss(model(x) * y.sum() / y.sum(), y)
        loss.backward()
        if guard.check(loss):
            opt.step()
        opt.zero_grad(set_to_none=True)
        tb.log()
    guard.close()
    tb.close()
    (escalated,) = [e["step"] for e in tg.read_events(tmp_path, 0) if e["kind"] == "rollback"]
    scalars = [(s.step, s.value) for s in _read(tmp_path / "tensorboard").Scalars(
        "trainguard/rollbacks"
    )]  # fmt: skip
    first = next(step for step, value in scalars if value == 1)
    assert first == escalated
    acc = _read(tmp_path / "tensorboard")
    losses = [(s.step, s.value) for s in acc.Scalars("trainguard/loss")]
    assert math.isnan(next(v for step, v in losses if step == escalated))  # its first point
    xs = [step for step, _ in losses]
    assert xs == list(range(len(xs)))  # forward only
    assert guard.global_step < len(xs)  # though the guard's own steps went back
    texts = _texts(acc)
    (rolled,) = [x for x, text in texts if text.startswith("**rollback**")]
    assert rolled == escalated  # the text beside its scalars
    skips = [x for x, text in texts if text.startswith("**skip**")]
    assert skips == sorted(set(skips))  # every skip at its own place on the axis


def test_the_sync_free_steps_last_numbers_are_written_at_the_guards_close(tmp_path: Path) -> None:
    """Under the sync-free ``step()`` the host reads a step during the next one, and the last
    one in ``close()``: a skip there still reaches the scalars, at its own step, beside its
    text."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, capture=False)
    tb = TensorBoardLogger(guard)
    steps = 6
    for i in range(steps):
        x = torch.randn(8, 4)
        if i == steps - 1:
            x[0, 0] = math.nan  # the last step is bad
        loss = model(x).pow(2).mean()
        loss.backward()
        guard.step(loss)
        tb.log()
    guard.close()
    tb.close()
    acc = _read(tmp_path / "tensorboard")
    skipped = {s.step: s.value for s in acc.Scalars("trainguard/skipped_steps")}
    assert skipped[steps - 1] == 1 and max(skipped) == steps - 1
    (skip_at,) = [s for s, t in _texts(acc) if t.startswith("**skip**")]
    assert skip_at == steps - 1


def test_two_runs_in_one_run_dir_are_two_tensorboard_runs(tmp_path: Path) -> None:
    """The default log directory is the run's own (``run_dir/tensorboard/<run id>``): a
    second run in the same ``run_dir`` does not write its steps into the first one's."""
    ids = []
    for _ in range(2):
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0)
        with TensorBoardLogger(guard) as tb:
            for x in guard.watch([torch.ones(4, 2)] * 3):
                loss = model(x).pow(2).mean()
                loss.backward()  # type: ignore[no-untyped-call]
                if guard.check(loss):
                    opt.step()
                opt.zero_grad()
                tb.log()
            guard.close()
        assert guard.events.run is not None
        ids.append(guard.events.run.id)
    assert ids[0] != ids[1]
    assert sorted(d.name for d in (tmp_path / "tensorboard").iterdir()) == sorted(ids)
    for run in ids:
        acc = EventAccumulator(str(tmp_path / "tensorboard" / run), size_guidance={"scalars": 0})
        acc.Reload()
        assert [s.step for s in acc.Scalars("trainguard/step")] == [0, 1, 2]  # each its own
