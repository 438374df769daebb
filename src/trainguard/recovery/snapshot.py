"""In-memory snapshots: a CPU copy of everything the next step depends on, at a step boundary.

A snapshot describes "the start of step s": weights, optimizer state (moments, step
counters, param_group values), LR scheduler, GradScaler, the loop's own stateful objects
(``Guard(extra_state=...)``), the guard's own state, this rank's RNG and the data position.
It becomes *good* once ``good_after`` healthy steps follow it; a bad step before that
discards it (it may already hold drifting weights). Rollback targets are good snapshots
only.

A CUDA tensor is copied into pinned host memory without a host sync (``copy_(...,
non_blocking=True)``, PyTorch's caching host allocator reusing the pinned blocks of the
snapshots dropped since): the copies run in stream order, before the optimizer step that
follows overwrites the weights, and an event recorded after them is waited on only when the
snapshot is read (a rollback). Blocking copies to pageable memory, one per tensor, cost a sync
each (78 on a 55M-parameter TinyGPT with AdamW) and about 100-170 ms a snapshot on an H100
(docs/benchmarks.md). A tensor whose pinned buffer cannot be had is copied as before.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from trainguard.capture.optim_state import load_optimizer_state, optimizer_state
from trainguard.capture.rng import rng_state, set_rng_state
from trainguard.errors import ConfigError


def to_cpu(tree: Any, staged: set[torch.device] | None = None) -> Any:
    """A deep copy of ``tree`` with every tensor copied to the CPU (DTensors keep their type).

    ``staged``: copy plain CUDA tensors into pinned memory without waiting, and add their
    devices to the set (then ``copies_done`` must be recorded before the copy is read)."""
    if isinstance(tree, Tensor):
        if staged is not None and tree.is_cuda and type(tree) in (Tensor, nn.Parameter):
            return _staged_copy(tree.detach(), staged)
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: to_cpu(value, staged) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_cpu(value, staged) for value in tree)
    return copy.deepcopy(tree)


def _staged_copy(tensor: Tensor, staged: set[torch.device]) -> Tensor:
    """A non-blocking copy into pinned host memory (a blocking one if none can be had)."""
    if tensor.layout != torch.strided:
        return tensor.to("cpu", copy=True)
    try:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    except RuntimeError:  # pinned memory refused (limits): the pageable copy
        return tensor.to("cpu", copy=True)
    out.copy_(tensor, non_blocking=True)
    staged.add(tensor.device)
    return out


def copies_done(devices: set[torch.device]) -> list[Any]:
    """One CUDA event per device, recorded on its current stream after the staged copies."""
    events = []
    for device in devices:
        with torch.cuda.device(device):
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            events.append(event)
    return events


@dataclass
class TrainingObjects:
    """What a snapshot or checkpoint saves and restores, besides the guard's own state."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    scaler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    """The loop's own stateful objects (``Guard(extra_state=...)``: an EMA model, a data
    curriculum), by name: ``state_dict()`` saved, ``load_state_dict()`` restored."""

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": optimizer_state(self.optimizer),
        }
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        if self.extra:
            out["extra"] = self.extra_state()
        return out

    def extra_state(self) -> dict[str, Any]:
        """Each extra object's ``state_dict()``, by name (references: copy before keeping)."""
        return {name: obj.state_dict() for name, obj in self.extra.items()}

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.load_extra(state.get("extra") or {})

    def load_extra(self, saved: dict[str, Any]) -> list[str]:
        """Load each extra object saved under its name; returns the names not saved (left
        as they are)."""
        missing = []
        for name, obj in self.extra.items():
            if name in saved:
                obj.load_state_dict(saved[name])
            else:
                missing.append(name)
        return missing


def stateful_objects(extra_state: Any) -> dict[str, Any]:
    """``Guard(extra_state=...)`` checked: a mapping of names to objects with
    ``state_dict()`` and ``load_state_dict()`` (``ConfigError`` naming the one that is not)."""
    if extra_state is None:
        return {}
    if not isinstance(extra_state, Mapping):
        raise ConfigError(
            "extra_state",
            f"got {type(extra_state).__name__}; pass a dict of names to objects with "
            "state_dict() and load_state_dict(), e.g. extra_state={'ema': ema_model}",
        )
    for name, obj in extra_state.items():
        if not isinstance(name, str):
            raise ConfigError("extra_state", f"the key {name!r} is not a string; name each object")
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise ConfigError(
                "extra_state",
                f"{name!r} ({type(obj).__name__}) has no state_dict() and load_state_dict(); "
                "pass an nn.Module, an optimizer or scheduler, or an object with both methods",
            )
    return dict(extra_state)


@dataclass
class Snapshot:
    step: int
    """The step this snapshot starts (its weights are those before step ``step``)."""
    position: int
    """Data position: the iterable's index of step ``step``'s first batch."""
    stream_id: int
    """Which ``watch()`` call (epoch) the position belongs to."""
    state: dict[str, Any]
    guard: dict[str, Any]
    rng: dict[str, Any]
    healthy: int = 0
    """Healthy steps seen after it (it is good once this reaches ``good_after``)."""
    first_loss: float | None = None
    """The loss of step ``step`` (the first step after the snapshot), once known."""
    extra: dict[str, Any] = field(default_factory=dict)
    copies: list[Any] = field(default_factory=list)
    """CUDA events after the non-blocking device-to-host copies of ``state`` (``to_cpu``):
    waited on before ``state`` is read."""

    def wait(self) -> None:
        """Until every copy into ``state`` has landed (a host wait: rollbacks only)."""
        for event in self.copies:
            event.synchronize()
        self.copies = []


def take(
    objects: TrainingObjects,
    step: int,
    position: int,
    stream_id: int,
    guard: dict[str, Any],
    extra: dict[str, Any],
) -> Snapshot:
    staged: set[torch.device] = set()
    state = to_cpu(objects.state(), staged)
    return Snapshot(
        step=step,
        position=position,
        stream_id=stream_id,
        state=state,
        guard=copy.deepcopy(guard),
        rng=rng_state(),
        extra=copy.deepcopy(extra),
        copies=copies_done(staged) if staged else [],
    )


def restore(objects: TrainingObjects, snapshot: Snapshot) -> None:
    """Load the snapshot into the live objects (tensors are copied: the snapshot stays usable)."""
    snapshot.wait()
    objects.load(to_cpu(snapshot.state))
    set_rng_state(snapshot.rng)


class SnapshotKeeper:
    """The newest ``keep`` good snapshots, plus the one still waiting to become good."""

    def __init__(self, every: int, good_after: int, keep: int = 1) -> None:
        self.every = every
        self.good_after = good_after
        self.keep = keep
        self.good: list[Snapshot] = []
        self.pending: Snapshot | None = None

    def due(self, step: int) -> bool:
        """A multiple of ``every`` while no snapshot waits to be judged: a newer one would
        replace it before ``good_after`` healthy steps made it good (with ``every`` below
        ``good_after`` none ever would), so a snapshot waits for the last one's verdict."""
        if self.every <= 0 or self.pending is not None:
            return False
        return step % self.every == 0

    def add(self, snapshot: Snapshot) -> None:
        self.pending = snapshot
        self._promote()

    def healthy_step(self, step: int, loss: float) -> None:
        pending = self.pending
        if pending is None or step < pending.step:
            return
        if step == pending.step:
            pending.first_loss = loss
        pending.healthy += 1
        self._promote()

    def bad_step(self) -> None:
        """A bad step before the pending snapshot became good: it is not a safe target."""
        self.pending = None

    def _promote(self) -> None:
        pending = self.pending
        if pending is not None and pending.healthy >= self.good_after:
            self.good.append(pending)
            self.good = self.good[-self.keep :]
            self.pending = None

    def target(self, first_bad_step: int) -> Snapshot | None:
        """The newest good snapshot taken no later than the first bad step of the streak."""
        for snapshot in reversed(self.good):
            if snapshot.step <= first_bad_step:
                return snapshot
        return None

    def drop_after(self, step: int) -> None:
        """After a rollback to ``step``: later snapshots describe a history that is gone."""
        self.good = [s for s in self.good if s.step <= step]
        self.pending = None
