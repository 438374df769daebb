"""nanoGPT's structure, ``DDP(torch.compile(model))`` (and DDP around a model compiled in place),
on 2 ranks: compiled once on every rank, not at every step (the guard's hooks are not traced:
tests/unit/step/test_compiled_models.py), the bad step skipped on both ranks with its buffers put
back, the ranks bit-identical to a run that never saw the bad batch, and each rank's forward
timed by hooks that run eagerly (the straggler rule's compute phase)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tg_buffer_models import BufferNet, batches, loss_fn, state_of
from tg_dist import run_ranks, values
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg

STEPS = 12
BAD_STEP = 9
HOW = ("wrapped", "in_place")


def _compiled(how: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = BufferNet()
    if how == "wrapped":
        return model, DDP(torch.compile(model, backend="eager"))
    model.compile(backend="eager")
    return model, DDP(model)


def _train(rank: int, how: str, bad_rank: int | None, run_dir: str | None) -> dict:
    torch._dynamo.reset()
    counters.clear()
    model, net = _compiled(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = batches(STEPS, bad=BAD_STEP if rank == bad_rank else None, rank=rank)
    if run_dir is None:
        data = [b for i, b in enumerate(data) if i != BAD_STEP]
    guard = tg.Guard(net, opt, run_dir=run_dir, hang_timeout=0) if run_dir else None
    graphs_after_warmup = None
    for step, batch in enumerate(guard.watch(data) if guard is not None else data):
        loss = loss_fn(net, batch)
        loss.backward()
        if guard is None or guard.check(loss):
            opt.step()
        opt.zero_grad()
        if step == 1:
            graphs_after_warmup = int(counters["stats"]["unique_graphs"])
    result = {
        "state": state_of(model),
        "graphs": (graphs_after_warmup, int(counters["stats"]["unique_graphs"])),
    }
    if guard is not None:
        guard.close()
        result["skipped"] = list(guard.state.nonfinite_steps)
        result["compute_times"] = [r.compute_times for r in guard.history.records()]
    return result


def _jobs(rank: int, world_size: int, shared: str) -> dict:
    return {
        how: {
            "guarded": _train(rank, how, 1, str(Path(shared, how))),
            "reference": _train(rank, how, None, None),
        }
        for how in HOW
    }


@pytest.mark.timeout(150)
def test_ddp_around_a_compiled_model_skips_together_and_stays_compiled(tmp_path: Path) -> None:
    results = values(run_ranks(_jobs, 2, str(tmp_path), timeout=140))
    for how in HOW:
        for rank, result in enumerate(r[how] for r in results):
            guarded, reference = result["guarded"], result["reference"]
            assert guarded["skipped"] == [BAD_STEP], (how, rank)
            warm, end = guarded["graphs"]
            assert warm is not None and warm >= 1 and end == warm, (how, rank, guarded["graphs"])
            assert end == reference["graphs"][1], (how, rank)  # as many as unguarded
            for name, value in reference["state"].items():
                assert torch.equal(guarded["state"][name], value), (how, rank, name)
            times = guarded["compute_times"]
            assert len(times) >= STEPS - 1 and all(t[0] > 0 for t in times), (how, rank, times)
        params = [name for name, _ in BufferNet().named_parameters()]  # buffers: each rank's
        states = [r[how]["guarded"]["state"] for r in results]  # last forward updated its own
        for name in params:  # (DDP broadcasts them at the next forward)
            assert torch.equal(states[0][name], states[1][name]), (how, name)
