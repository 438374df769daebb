"""A collective mismatch, end to end: real processes, gloo, DDP, the job's own c10d store.

Rank 0 alone calls ``dist.barrier()`` after step 15 (as if it saved a checkpoint) while ranks
1-3 go on into step 16's backward, where DDP's gradient all-reduce waits for rank 0. Every
rank must exit with 91 within the hang timeout + 15 s, with one report naming rank 0 and
its barrier's line, from torch's flight recorder and, with the recorder off, from the
stacks alone.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tg_dist import run_ranks
from tg_models import TinyNet, loss_fn, make_batches
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import trainguard as tg

TIMEOUT_S = 2.0
SLACK_S = 15.0
"""The issue's bound: every rank is gone within hang_timeout + 15 s of the lone barrier."""
BARRIER_STEP = 15
EVAL_CALLS = 4 * int(TIMEOUT_S / 0.03)
"""The evaluation's collectives: four hang timeouts at the slowest rank's 30 ms a call."""
RUN_LIMIT_S = 100.0
"""Spawning 4 ranks that import torch takes seconds on an idle 2-core machine, much longer on
a busy one; the bound that matters is SLACK_S, from the barrier on."""


def train_with_a_lone_barrier_in_a_phase(rank: int, world_size: int, run_dir: str) -> str:
    """The same, the save and the barrier in ``guard.phase("checkpoint")`` (as the docs
    advise for rank-0 work): a phase excuses slowness, not a deadlock."""
    return train_with_a_lone_barrier(rank, world_size, run_dir, in_phase=True)


def tiny_ddp() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyNet())
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_pass(guard: tg.Guard, model: nn.Module, batches: list[Any]) -> None:
    for batch in guard.watch(batches):
        loss = loss_fn(model, batch)
        loss.backward()
        guard.step(loss)


def train_with_a_lone_barrier(
    rank: int, world_size: int, run_dir: str, in_phase: bool = False
) -> str:
    progress = Path(run_dir, f"progress-rank{rank}")
    progress.write_text("started")
    model, optimizer = tiny_ddp()
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=TIMEOUT_S) as guard:
        for batch in guard.watch(make_batches(100, seed=rank)):
            loss = loss_fn(model, batch)
            loss.backward()  # BACKWARD
            guard.step(loss)
            progress.write_text(f"step {guard.state.step}")
            if rank == 0 and guard.state.step == BARRIER_STEP:
                Path(run_dir, "barrier").write_text(repr(time.time()))
                with guard.phase("checkpoint") if in_phase else contextlib.nullcontext():
                    dist.barrier()  # BARRIER
    return "finished"


def train_then_deadlock_between_loops(rank: int, world_size: int, run_dir: str) -> str:
    """A pass of training, then every rank outside its loop: rank 0 waits in its
    checkpoint's barrier while the others wait in an all-reduce of their own evaluation."""
    model, optimizer = tiny_ddp()
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=TIMEOUT_S) as guard:
        train_pass(guard, model, make_batches(10, seed=rank))
        Path(run_dir, f"between-{rank}").write_text(repr(time.time()))
        if rank == 0:
            dist.barrier()  # EPOCH_END_BARRIER
        else:
            dist.all_reduce(torch.ones(3))  # EVAL_ALL_REDUCE
    return "finished"


def train_then_evaluate_between_loops(rank: int, world_size: int, run_dir: str) -> str:
    """A pass of training, then a distributed evaluation far longer than the hang timeout
    (collectives of several kinds and sizes, each rank at its own pace), then another pass."""
    model, optimizer = tiny_ddp()
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=TIMEOUT_S) as guard:
        for epoch in range(2):
            train_pass(guard, model, make_batches(5, seed=rank + 10 * epoch))
            started = time.monotonic()
            for call in range(EVAL_CALLS):  # the same calls on every rank, as they must be
                dist.all_reduce(torch.ones(1 + call % 7))
                if call % 3 == 0:
                    dist.barrier()
                time.sleep(0.01 * (1 + rank))
            Path(run_dir, f"eval-{epoch}-rank{rank}").write_text(repr(time.monotonic() - started))
    return "finished"


def line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.endswith(f"# {marker}"))


def only_report(run_dir: Path) -> tuple[dict[str, Any], str]:
    reports = sorted((run_dir / "hangs").glob("*/report.json"))
    assert len(reports) == 1, reports
    text = (reports[0].parent / "report.txt").read_text()
    return json.loads(reports[0].read_text()), text


def progress_of(run_dir: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(run_dir.glob("progress-rank*"))}


def run_and_check(
    run_dir: Path, source: str, train: Callable[[int, int, str], str] = train_with_a_lone_barrier
) -> tuple[dict[str, Any], str]:
    try:
        results = run_ranks(train, 4, str(run_dir), timeout=RUN_LIMIT_S)
    except TimeoutError as exc:  # where each rank got to: a slow start or a missed hang?
        raise AssertionError(f"{exc}; progress: {progress_of(run_dir)}") from exc
    gone = time.time()

    assert [r.exitcode for r in results] == [tg.EXIT_HANG] * 4, [r.traceback for r in results]
    assert gone - float((run_dir / "barrier").read_text()) < TIMEOUT_S + SLACK_S
    report, text = only_report(run_dir)
    assert report["kind"] == "hang"
    assert report["culprits"] == [0]
    here = Path(__file__).name
    barrier, backward = f"{here}:{line_of('BARRIER')}", f"{here}:{line_of('BACKWARD')}"
    line = (
        f"rank 0 waits in barrier ({barrier}) while ranks 1-3 wait in DDP's gradient "
        f"all_reduce ({backward})"
    )
    assert line in text
    mismatch = report["collective_mismatch"]
    assert mismatch["kind"] == "op" and mismatch["culprits"] == [0]
    assert mismatch["source"] == source
    records = {r["rank"]: r["collective"] for r in report["ranks"]}
    assert {rank: records[rank]["source"] for rank in range(4)} == dict.fromkeys(range(4), source)
    assert records[0]["op"] == "barrier" and records[0]["site"] == barrier
    for rank in (1, 2, 3):
        assert records[rank]["op"] == "all_reduce" and records[rank]["site"] == backward
    folder = run_dir / "hangs" / report["id"]
    assert "collective: barrier" in (folder / "rank-0.txt").read_text()
    for rank in range(4):
        if rank:
            dump = (folder / f"rank-{rank}.txt").read_text()
            assert "collective: DDP's gradient all_reduce" in dump
        hangs = [e for e in tg.read_events(run_dir, rank) if e["kind"] == "hang"]
        assert len(hangs) == 1 and hangs[0]["culprits"] == [0]
        assert line in hangs[0]["reason"]
    return report, text


@pytest.mark.timeout(120)
def test_a_lone_barrier_is_named_from_the_flight_recorder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    report, _ = run_and_check(tmp_path, "flight_recorder")

    mismatch = report["collective_mismatch"]
    records = {r["rank"]: r["collective"] for r in report["ranks"]}
    seq = mismatch["seq"]
    assert records[0]["seq"] == seq and all(records[r]["seq"] == seq for r in (1, 2, 3))
    assert records[1]["sizes"] == [[212]]  # TinyNet's 212 parameters in one bucket
    assert all(records[r]["last"][-1][3] is False for r in range(4))  # the pending one


@pytest.mark.timeout(120)
def test_a_lone_barrier_is_named_from_the_stacks_with_the_recorder_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    report, text = run_and_check(tmp_path, "stack")

    assert report["collective_mismatch"]["seq"] is None
    assert "ranks 0-3: flight recorder off (TORCH_FR_BUFFER_SIZE=0)" in text
    assert all("TORCH_FR_BUFFER_SIZE=0" in r["collective"]["note"] for r in report["ranks"])


@pytest.mark.timeout(120)
def test_a_lone_barrier_in_a_user_phase_is_named_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    report, _ = run_and_check(tmp_path, "flight_recorder", train_with_a_lone_barrier_in_a_phase)
    assert "in a user phase, collective mismatch" in report["reason"]
    phases = {r["rank"]: r["phase"] for r in report["ranks"]}
    assert phases[0] == "checkpoint"


@pytest.mark.timeout(120)
def test_a_deadlock_between_two_loops_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Detection pauses while every rank is between two ``watch()`` loops (a long evaluation
    is no hang), but a deadlock there is one: every rank exits with 91, rank 0 named."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    results = run_ranks(train_then_deadlock_between_loops, 3, str(tmp_path), timeout=RUN_LIMIT_S)
    gone = time.time()

    assert [r.exitcode for r in results] == [tg.EXIT_HANG] * 3, [r.traceback for r in results]
    started = max(float((tmp_path / f"between-{r}").read_text()) for r in range(3))
    assert gone - started < TIMEOUT_S + SLACK_S
    report, text = only_report(tmp_path)
    assert report["kind"] == "hang" and report["culprits"] == [0]
    here = Path(__file__).name
    line = (
        f"outside the training loop, collective mismatch at sequence id "
        f"{report['collective_mismatch']['seq']}: rank 0 waits in barrier "
        f"({here}:{line_of('EPOCH_END_BARRIER')}) while ranks 1, 2 wait in all_reduce"
    )
    assert line in report["reason"], report["reason"]
    assert [r["phase"] for r in report["ranks"]] == ["done"] * 3
    assert f"({here}:{line_of('EVAL_ALL_REDUCE')})" in text


@pytest.mark.timeout(120)
def test_a_long_distributed_evaluation_between_loops_is_no_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank between two loops for four hang timeouts, in and out of collectives at
    its own pace: the records are read at different moments, and no mismatch is made of
    them."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    results = run_ranks(train_then_evaluate_between_loops, 3, str(tmp_path), timeout=RUN_LIMIT_S)
    assert [r.value for r in results] == ["finished"] * 3, [r.traceback for r in results]
    assert not list(tmp_path.glob("hangs/*/report.json"))
    evaluations = [float(p.read_text()) for p in tmp_path.glob("eval-*-rank*")]
    assert len(evaluations) == 6 and min(evaluations) > 3 * TIMEOUT_S
