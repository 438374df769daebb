"""Work one rank does alone between steps while the others wait in the next collective is
not a hang: a long ``torch.save`` (``hang/saves.py``) and an evaluation of another module,
an EMA copy made before the guard (``hang/busy.py``). The same under ``trainguard run``:
test_run_attach.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from run_scripts.train_ddp import SlowFile, evaluate
from tg_dist import run_ranks
from tg_models import TinyNet, loss_fn, make_batches

import trainguard as tg


def rank0_works_alone(
    rank: int, world_size: int, run_dir: str, timeout: float, mark_saves: bool
) -> tuple[int, list[float]]:
    """At step 4 rank 0 alone writes a checkpoint (``torch.save``), then evaluates an EMA
    copy made before the guard, each for longer than the hang timeout and unmarked by the
    loop, while rank 1 waits in a barrier."""
    import torch.distributed as dist

    torch.manual_seed(0)
    net = TinyNet()
    ema = copy.deepcopy(net)
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = tg.GuardConfig(
        run_dir=run_dir, hang_timeout=timeout, hang=tg.HangConfig(mark_saves=mark_saves)
    )
    with tg.Guard(model, optimizer, config=config) as guard:
        for batch in guard.watch(make_batches(8, seed=rank)):
            loss = loss_fn(model, batch)
            loss.backward()
            guard.step(loss)
            if guard.state.step == 4:
                if rank == 0:
                    file = SlowFile(delay=2.5 * timeout)
                    torch.save({"model": model.state_dict(), "step": 4}, file)
                    file.seek(0)
                    assert torch.load(file)["step"] == 4
                    evaluate(ema, seconds=2.5 * timeout)
                dist.barrier()
        return guard.state.step, [float(p.detach().sum()) for p in model.parameters()]


@pytest.mark.timeout(90)
def test_a_long_save_and_ema_evaluation_on_one_rank_are_not_a_hang(tmp_path: Path) -> None:
    timeout = 2.0
    results = run_ranks(rank0_works_alone, 2, str(tmp_path), timeout, True, timeout=75)

    assert [(r.exitcode, r.error_type) for r in results] == [(0, None)] * 2
    assert [r.value[0] for r in results] == [8, 8]
    assert results[0].value[1] == results[1].value[1]  # the same weights on both ranks
    assert not (tmp_path / "hangs").exists()
    for rank in range(2):
        assert "hang" not in [e["kind"] for e in tg.read_events(tmp_path, rank)]


@pytest.mark.timeout(90)
def test_an_unmarked_long_save_is_a_hang_named_after_the_saving_rank(tmp_path: Path) -> None:
    """The control: the same save with ``mark_saves=False`` outlasts the timeout."""
    timeout = 2.0
    results = run_ranks(rank0_works_alone, 2, str(tmp_path), timeout, False, timeout=75)

    assert [r.exitcode for r in results] == [tg.EXIT_HANG] * 2
    (path,) = (tmp_path / "hangs").glob("*/report.json")
    report = json.loads(path.read_text())
    assert report["kind"] == "hang" and report["culprits"] == [0]
