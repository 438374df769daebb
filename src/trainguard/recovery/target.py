"""The rollback target: the newest good in-memory snapshot, or a good checkpoint on disk.

Both must start no later than the first bad step of the failing streak. A checkpoint is
used when it is newer than the snapshot (or there is no snapshot: ``snapshot_every=0``);
loading it is collective, like the choice (the guard checks every rank chose the same).
"""

from __future__ import annotations

from pathlib import Path

from trainguard.capture.rng import set_rng_state
from trainguard.recovery import checkpoint as ckpt
from trainguard.recovery import snapshot as snap


def disk_target(run_dir: Path, first_bad: int, epoch: int, stream_id: int) -> snap.Snapshot | None:
    """The newest good checkpoint of a step <= ``first_bad``, as a snapshot to load lazily."""
    for path in ckpt.good_checkpoints(run_dir):
        step = ckpt.step_of(path)
        if step > first_bad:
            continue
        return snap.Snapshot(
            step=step,
            position=0,
            stream_id=stream_id,
            state={},
            guard={},
            rng={},
            first_loss=ckpt.first_loss(path),
            extra={"path": path, "epoch": epoch},
        )
    return None


def choose(memory: snap.Snapshot | None, disk: snap.Snapshot | None) -> snap.Snapshot | None:
    if disk is None:
        return memory
    if memory is None or disk.step > memory.step:
        return disk
    return memory


def from_disk(target: snap.Snapshot) -> bool:
    return "path" in target.extra


def restore(objects: snap.TrainingObjects, target: snap.Snapshot, rank: int) -> None:
    """Load ``target`` into the live objects (collective for a checkpoint on disk)."""
    if not from_disk(target):
        snap.restore(objects, target)
        return
    extras = ckpt.load(Path(target.extra["path"]), objects, rank)
    set_rng_state(extras["rng"])
    target.guard = extras["guard"]
    data = extras["data"]
    target.position = int(data["position"])
    target.extra["recovery"] = extras.get("recovery", {})
    if int(data["epoch"]) != target.extra["epoch"]:
        # saved in an earlier epoch: this epoch's batches all count, and that epoch's from
        # the position on (``undone.py``: the manager finds its pass by the epoch)
        target.stream_id = -1
        target.extra["data_epoch"] = int(data["epoch"])
