"""Capture on real 2-rank gloo runs (DDP and FSDP2), replayed here in one process.

Cross-rank properties: both ranks return the same bundle path, both rank folders are in the
bundle and consistent with the agreement, a write failure on one rank is a failure on every
rank (and the run goes on), and an FSDP2 bundle replays into an unsharded model.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import tg_capture_models as models
import torch
from tg_dist import run_ranks, values

import trainguard as tg
from trainguard.capture.inspect import inspect_bundle
from trainguard.replay.runner import load_weights


def _events(run_dir: str, rank: int, kind: str) -> list[dict[str, Any]]:
    return [e for e in tg.read_events(run_dir, rank) if e["kind"] == kind]


def _ddp_worker(rank: int, world: int, run_dir: str, failing_dir: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from trainguard.step import capturer as capture

    data = models.batches("forward", 4, bad_step=2 if rank == 1 else -1, seed=rank)
    model = DistributedDataParallel(models.make_model("forward"))
    guard = models.train(model, models.ce_loss, data, run_dir)
    out: dict[str, Any] = {"state": guard.state.state_dict()}
    out["captures"] = _events(run_dir, rank, "capture")

    if rank == 1:  # the second run: rank 1 cannot write its part of the bundle

        def denied(path: Path, obj: Any) -> Any:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

        capture.write_torch = denied  # type: ignore[assignment]
    model = DistributedDataParallel(models.make_model("forward"))
    guard = models.train(model, models.ce_loss, data, failing_dir)
    out["failing_state"] = guard.state.state_dict()
    out["failed"] = _events(failing_dir, rank, "capture_failed")
    return out


@pytest.mark.timeout(120)
def test_ddp_bundle_from_both_ranks_replays_in_one_process(tmp_path: Path) -> None:
    run_dir, failing_dir = tmp_path / "run", tmp_path / "failing"
    ranks = values(run_ranks(_ddp_worker, 2, str(run_dir), str(failing_dir), timeout=100))

    # every rank took the same decision and returned the same bundle
    bundle_path = run_dir / "captures" / "step-00000002"
    for r in ranks:
        assert r["state"]["nonfinite_steps"] == [2] and r["state"]["step"] == 4
        assert [(e["step"], e["path"]) for e in r["captures"]] == [(2, str(bundle_path))]
    bundle = tg.load_bundle(bundle_path)
    assert (bundle.world_size, bundle.ranks, bundle.saved_ranks) == (2, [1], [0, 1])
    assert bundle.manifest["loss_ranks"] == [1] and bundle.manifest["grad_ranks"] == [0, 1]
    # one part per rank, and the run's history once (agreed values, written by rank 0)
    assert {n.split("/")[0] for n in bundle.files} == {"rank-0", "rank-1", "history.json"}
    assert bundle.history is not None and bundle.history[-1]["step"] == 2
    meta0, meta1 = bundle.meta(0), bundle.meta(1)
    assert meta1["loss"] == "nan" and isinstance(meta0["loss"], float)
    assert meta1["dataset_indices"] == [list(range(1016, 1024))]
    assert meta0["env"]["rank"] == 0 and meta1["env"]["rank"] == 1
    assert meta0["env"]["backend"] == "gloo"
    summary = inspect_bundle(bundle)
    assert summary["weights_identical_across_ranks"] is True

    # rank 1 made the NaN; rank 0's own step is finite (its NaN came through the all-reduce)
    report = tg.replay(bundle, models.forward_factory).to_dict()
    assert (report["rank"], report["phase"], report["module"]) == (
        1,
        "forward",
        "encoder.layers.0.norm",
    )
    assert report["culprit_samples"] == [{"micro_batch": 0, "position": 5, "index": 1021}]
    rank0 = tg.replay(bundle, models.forward_factory, rank=0, repeats=1).to_dict()
    assert rank0["verdict"] == "not_reproduced"

    # a write failure on rank 1 is a failure on both ranks; nothing half-written; run goes on
    for r in ranks:
        (failed,) = r["failed"]
        assert failed["step"] == 2 and "rank 1: PermissionError" in failed["error"]
        assert r["failing_state"]["step"] == 4 and r["failing_state"]["last_good_step"] == 3
    assert not list((failing_dir / "captures").iterdir())


def _fsdp_worker(rank: int, world: int, run_dir: str) -> dict[str, Any] | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = models.make_model("forward")
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    data = models.batches("forward", 3, bad_step=2 if rank == 1 else -1, seed=rank)
    guard = models.train(model, models.ce_loss, data, run_dir)  # the bad step is the last
    full = {name: t.full_tensor() for name, t in model.state_dict().items()}
    captures = _events(run_dir, rank, "capture")
    return {"full": full if rank == 0 else None, "captures": captures, "step": guard.state.step}


@pytest.mark.timeout(120)
def test_fsdp2_shards_replay_into_an_unsharded_model(tmp_path: Path) -> None:
    ranks = values(run_ranks(_fsdp_worker, 2, str(tmp_path), timeout=100))
    bundle_path = tmp_path / "captures" / "step-00000002"
    assert [r["captures"][0]["path"] for r in ranks] == [str(bundle_path)] * 2
    bundle = tg.load_bundle(bundle_path)
    assert bundle.sharded and bundle.ranks == [1]
    dcp_files = sorted(n for n in bundle.files if n.startswith("dcp/"))
    assert "dcp/.metadata" in dcp_files and len(dcp_files) == 3  # metadata + one shard a rank
    assert not any(n.endswith("model.pt") for n in bundle.files)

    model, _ = models.forward_factory()
    load_weights(model, bundle, 1)
    for name, value in ranks[0]["full"].items():  # the skipped step left the weights as captured
        assert torch.equal(model.state_dict()[name], value), name

    report = tg.replay(bundle, models.forward_factory).to_dict()
    assert (report["phase"], report["op"], report["module"]) == (
        "forward",
        "aten.div",
        "encoder.layers.0.norm",
    )
    assert report["culprit_samples"] == [{"micro_batch": 0, "position": 5, "index": 1021}]
