"""Under DDP a skipped step leaves no trace either: DDP's ``broadcast_buffers`` spreads rank
0's buffers to every rank at the next forward, so a bad forward's BatchNorm statistics would
reach every rank; with the restore every rank ends bit-identical to a run that never saw the
bad step's batches, whichever rank the bad sample was on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tg_buffer_models import BufferNet, batches, loss_fn, state_of
from tg_dist import run_ranks, values
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from trainguard.capture import inspect_bundle

STEPS = 8
BAD_STEP = 3


def _train(
    rank: int, world_size: int, bad_rank: int | None, drop_bad_step: bool, shared: str
) -> dict:
    torch.manual_seed(0)
    model = DDP(BufferNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = batches(STEPS, bad=BAD_STEP if rank == bad_rank else None, rank=rank)
    if drop_bad_step:
        data = [b for i, b in enumerate(data) if i != BAD_STEP]
    run_dir = str(Path(shared, f"bad{bad_rank}-drop{drop_bad_step}"))
    guard = tg.Guard(model, opt, run_dir=run_dir, hang_timeout=0, capture=not drop_bad_step)
    with guard:
        for batch in guard.watch(data):
            loss = loss_fn(model, batch)
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    skipped = list(guard.state.nonfinite_steps)
    bundles = sorted(Path(run_dir, "captures").glob("step-*"))
    identical = inspect_bundle(bundles[0])["weights_identical_across_ranks"] if bundles else None
    return {"state": state_of(model), "skipped": skipped, "identical": identical}


def _jobs(rank: int, world_size: int, bad_rank: int, shared: str) -> dict:
    return {
        "guarded": _train(rank, world_size, bad_rank, False, shared),
        "reference": _train(rank, world_size, None, True, shared),
    }


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_ddp_skip_leaves_every_rank_as_if_the_batches_never_came(
    bad_rank: int, tmp_path: Path
) -> None:
    results = values(run_ranks(_jobs, 2, bad_rank, str(tmp_path), timeout=90))
    for rank, result in enumerate(results):
        guarded, reference = result["guarded"], result["reference"]
        assert guarded["skipped"] == [BAD_STEP], rank  # the same decision on every rank
        assert reference["skipped"] == []
        # the ranks' BatchNorm statistics differ under DDP by design; the weights do not
        assert guarded["identical"] is True
        for key, want in reference["state"].items():
            got = guarded["state"][key]
            assert torch.equal(got, want), f"rank {rank} {key}: {got} != {want}"
    params = [name for name, _ in BufferNet().named_parameters()]
    for key in params:  # the replicas' weights agree (buffers are each rank's own, as in DDP)
        assert torch.equal(results[0]["guarded"]["state"][key], results[1]["guarded"]["state"][key])
