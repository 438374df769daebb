"""Sharded state (FSDP2): each rank's shard of a snapshot is kept on a peer too.

Under FSDP2 no rank holds another's shard, so a lost rank's part of the step in flight is
gone with it. What can be kept is its shard of the newest in-memory snapshot: when a snapshot
is taken (every ``recovery.snapshot_every`` steps) each rank sends its own, serialized, to
the next rank in a ring (``exchange``: one size and one payload send/recv pair over the
guard's group, the cost measured in the ``failure_shards`` event), and keeps the previous
rank's. At a failure every survivor writes both (``writer.py``), so a resume finds every
rank's shard of that snapshot unless two neighbours were lost, and falls back to the newest
complete state otherwise (``fresh.py``: each shard is sent to its owner over the new process
group). The step in flight itself is resumed only when every rank wrote its own state at it
(a hang every rank survives).

DTensors travel as their local tensors (``localize``) and become DTensors again on the
restarted process (``globalize``), laid out as its own model's parameters.
"""

from __future__ import annotations

import io
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from trainguard.recovery.snapshot import TrainingObjects

LOCAL = "__dtensor_local__"


def localize(tree: Any) -> Any:
    """``tree`` with each DTensor replaced by its local shard (a CPU copy), marked."""
    if type(tree).__name__ == "DTensor":
        return {LOCAL: tree.to_local().detach().to("cpu", copy=True)}
    if isinstance(tree, Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: localize(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(localize(value) for value in tree)
    return tree


def _like(value: Any, like: Any) -> Any:
    """A marked local shard as a DTensor laid out as ``like`` (a live DTensor)."""
    if isinstance(value, dict) and LOCAL in value:
        if type(like).__name__ != "DTensor":
            raise ValueError("a shard of a DTensor, where the model holds a plain tensor")
        from torch.distributed.tensor import DTensor

        local = value[LOCAL].to(like.device)
        return DTensor.from_local(
            local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
        )
    return value


def globalize(state: dict[str, Any], objects: TrainingObjects) -> dict[str, Any]:
    """A localized ``TrainingObjects.state()`` made loadable into the live objects."""
    out = dict(state)
    live = objects.model.state_dict()
    out["model"] = {key: _like(value, live.get(key)) for key, value in state["model"].items()}
    optimizer = dict(state["optimizer"])
    params = [p for group in objects.optimizer.param_groups for p in group["params"]]
    optimizer["state"] = {
        index: {key: _like(value, params[int(index)]) for key, value in entry.items()}
        for index, entry in optimizer.get("state", {}).items()
    }
    out["optimizer"] = optimizer
    return out


def serialize(payload: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


class PeerShards:
    """This rank's newest snapshot payload and the previous rank's (see the docstring)."""

    def __init__(self, rank: int, world: int, group: dist.ProcessGroup | None) -> None:
        self.rank = rank
        self.world = world
        self.group = group
        self.own: tuple[int, bytes] | None = None
        """(step, payload) of this rank's newest snapshot."""
        self.held: tuple[int, int, bytes] | None = None
        """(step, owner rank, payload) of the previous rank's."""

    def exchange(self, step: int, payload: dict[str, Any]) -> float:
        """Collective (every rank at the same snapshot): keep this rank's payload, send it
        to the next rank, keep the previous rank's. Returns the seconds it took."""
        start = time.perf_counter()
        blob = serialize(payload)
        self.own = (step, blob)
        if self.world > 1:
            left = (self.rank - 1) % self.world
            data = _ring(blob, (self.rank + 1) % self.world, left, self.group)
            self.held = (step, left, data)
        return time.perf_counter() - start


def _ring(blob: bytes, right: int, left: int, group: dist.ProcessGroup | None) -> bytes:
    """Send ``blob`` to ``right``, receive ``left``'s (group ranks)."""
    to, frm = right, left
    if group is not None:
        to, frm = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    size = torch.tensor([len(blob)], dtype=torch.int64)
    their = torch.empty(1, dtype=torch.int64)
    _pair(size, to, their, frm, group)
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    received = torch.empty(int(their.item()), dtype=torch.uint8)
    _pair(data, to, received, frm, group)
    return received.numpy().tobytes()


def _pair(send: Tensor, to: int, recv: Tensor, frm: int, group: dist.ProcessGroup | None) -> None:
    ops = [
        dist.P2POp(dist.isend, send, to, group=group),
        dist.P2POp(dist.irecv, recv, frm, group=group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
