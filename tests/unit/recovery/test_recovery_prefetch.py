"""Recovery in a loop that fetches the next batch before the optimizer step (nanoGPT does):
snapshots and checkpoints describe the true start of a step (its first forward) and the
position of that step's first batch, and a rollback does not count the batch the loop holds
as skipped (the loop trains the restored step on it)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import trainguard as tg
from trainguard.events import read_events

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "single process"


def _data(bad: tuple[int, ...] = ()) -> list[Tensor]:
    return [torch.full((2, 4), float("nan") if i in bad else i / 16) for i in range(14)]


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _params(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _prefetching(
    run_dir: Path, data: list[Tensor], crash_at: int | None = None, **options: Any
) -> dict[str, Any]:
    """The loop fetches the next batch right after the forward, before backward and update."""
    model, opt = _model()
    config = tg.GuardConfig.from_options(
        {"run_dir": run_dir, "hang_timeout": 0, "capture": False, **options}
    )
    trained: list[tuple[int, int]] = []  # (guard step, batch index)
    at_start: dict[int, Tensor] = {}
    restored: list[bool] = []
    with warnings.catch_warnings(), tg.Guard(model, opt, config=config) as guard:
        warnings.simplefilter("ignore")
        batches = iter(guard.watch(data))
        x: Tensor | None = next(batches)
        while x is not None:
            step = guard.state.step
            if step == crash_at:
                return {"trained": trained}
            at_start[step] = _params(model)
            loss = model(x).pow(2).mean()
            trained.append((step, round(float(x[0, 0]) * 16) if x.isfinite().all() else -1))
            x = next(batches, None)  # the prefetch
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad(set_to_none=True)
            if guard.state.step <= step:  # rolled back
                restored.append(torch.equal(_params(model), at_start[guard.state.step]))
    return {"trained": trained, "params": _params(model), "restored": restored}


def _plain(indices: list[int]) -> Tensor:
    """What training on exactly these batches gives, in a plain loop."""
    model, opt = _model()
    data = _data()
    for i in indices:
        model(data[i]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def test_rollback_in_a_prefetching_loop_skips_the_bad_steps_batches_only(tmp_path: Path) -> None:
    run = _prefetching(
        tmp_path,
        _data(bad=(7, 8)),
        on_escalation="rollback",
        max_consecutive=2,
        **{"recovery.snapshot_every": 2, "recovery.good_after": 1},
    )
    [event] = [e for e in read_events(tmp_path, 0) if e["kind"] == "rollback"]
    assert (event["step"], event["restored_step"]) == (8, 6)
    assert run["restored"] == [True]  # the weights the restored step started from
    assert event["batches_skipped"] == [6, 7, 8]  # steps 6-8's; not batch 9, held by the loop
    after = [index for step, index in run["trained"][9:]]
    assert after == [9, 10, 11, 12, 13] and run["trained"][9][0] == 6
    # Nothing the rollback threw away reached the weights, nothing trained was left out:
    torch.testing.assert_close(run["params"], _plain([0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13]))


def test_resume_in_a_prefetching_loop_continues_at_the_checkpoints_batch(tmp_path: Path) -> None:
    good = {"recovery.good_after": 1}
    whole = _prefetching(tmp_path / "whole", _data(), checkpoint_every=3, **good)
    run_dir = tmp_path / "crashed"
    first = _prefetching(run_dir, _data(), crash_at=8, checkpoint_every=3, **good)
    assert first["trained"] == whole["trained"][:8]
    again = _prefetching(run_dir, _data(), checkpoint_every=3, resume=True, **good)
    [event] = [e for e in read_events(run_dir, 0) if e["kind"] == "resume"]
    assert (event["from_step"], event["position"]) == (6, 6)
    assert again["trained"] == whole["trained"][6:]  # steps 6.. again: none lost or repeated
    assert torch.equal(again["params"], whole["params"])


def test_a_new_run_in_the_same_run_dir_feeds_the_batches_an_earlier_run_skipped(
    tmp_path: Path,
) -> None:
    """The skip ledger is read back only by a resume of its own run: a re-run of the script
    (a new run) in the same ``run_dir`` trains on every batch of its data."""
    rollback = {
        "on_escalation": "rollback",
        "recovery.snapshot_every": 2,
        "recovery.good_after": 1,
        "max_consecutive": 2,
    }
    _prefetching(tmp_path, _data(bad=(7, 8)), **rollback)
    [event] = [e for e in read_events(tmp_path, 0) if e["kind"] == "rollback"]
    assert event["batches_skipped"] == [6, 7, 8]
    again = _prefetching(tmp_path, _data(), **rollback)
    assert [index for _, index in again["trained"]] == list(range(14))
    torch.testing.assert_close(again["params"], _plain(list(range(14))))
    # the same run continued without the guard's resume (a loop resuming from its own
    # checkpoint: the stream's positions are the loop's), the same
    more = _prefetching(tmp_path, _data()[6:], run=event["run"], **rollback)
    assert [index for _, index in more["trained"]] == list(range(6, 14))


@pytest.mark.parametrize(
    ("options", "skipped"),
    [
        # snapshots in memory, the loop prefetching, one more batch of margin: the first
        # rollback drops batch 10 (never handed out); the second's span from the held batch 9
        # covers it again
        (
            {"recovery.snapshot_every": 2, "recovery.skip_margin": 1, "prefetch": True},
            [[6, 7, 8, 10], [9, 11, 13]],
        ),
        # a checkpoint on disk, older than the first rollback: the second rollback to it
        # spans the batches the first one skipped
        (
            {"recovery.snapshot_every": 0, "checkpoint_every": 4},
            [[4, 5, 6, 7, 8], [9, 10, 11, 12]],
        ),
    ],
    ids=["memory-prefetch-margin", "disk"],
)
def test_consecutive_rollbacks_record_each_skipped_batch_once(
    tmp_path: Path, options: dict[str, Any], skipped: list[list[int]]
) -> None:
    """The stream never hands a batch out twice: a rollback whose span covers batches an
    earlier one skipped records only the new ones, in its event and in the skip ledger."""
    from tg_recovery import train

    prefetch = options.pop("prefetch", False)
    config = tg.GuardConfig.from_options(
        {
            "run_dir": tmp_path,
            "on_escalation": "rollback",
            "max_consecutive": 2,
            "capture": False,
            "hang_timeout": 0,
            "recovery.good_after": 1,
            "recovery.max_rollbacks": 5,
            **options,
        }
    )
    bad = range(7, 14) if prefetch else (7, 8, 11, 12)
    poison = {i: float("nan") for i in bad}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = train(0, "plain", tmp_path, 30, poison, prefetch=prefetch, config=config)
    rollbacks = [e["batches_skipped"] for e in run["events"] if e["kind"] == "rollback"]
    assert rollbacks[:2] == skipped
    ledger = tmp_path / "recovery" / "skipped-rank0.jsonl"
    positions = [json.loads(line)["batch"] for line in ledger.read_text().splitlines()]
    assert len(positions) == len(set(positions)), positions
    assert sorted(positions) == sorted(p for skip in rollbacks for p in skip)
