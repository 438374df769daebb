"""Module buffers are part of the step: what a skipped step's forward wrote is put back.

A forward pass writes module buffers (BatchNorm's ``running_mean``/``running_var`` and
``num_batches_tracked``, an EMA normaliser's statistics, counters). When the step is not
applied (a non-finite or spike skip, an fp16 overflow, an escalation or a rollback), those
writes must go too: a skipped step leaves the model as if its batch had never been seen.

Only what the forward really changes is copied. Each buffer's identity and autograd version
counter (``Tensor._version``, bumped by in-place writes) are read at the step's start and
again when the step is decided; a buffer whose version or identity moved is *tracked*, with
every buffer of the same module (native kernels such as BatchNorm's write their running
statistics without a version bump; ``num_batches_tracked`` beside them bumps). The first
step copies every buffer and also compares values (nothing is known yet); later steps copy
only the tracked ones, into storage kept from step to step (no allocation). A buffer first
written at a later step (a branch the forward rarely takes) is tracked from then on; if that
very step is skipped it cannot be put back, and the guard says so (``buffers_not_restored``).
A skip puts back only what differs from the copy (a value compare, on bad steps only).

Two copies are kept in turn, so the sync-free ``guard.step()`` (which reads its decision a
step late) still holds a skipped step's pre-step values when it captures that step. Its
restore runs on the device from the agreed flag (``torch.where``), with no host read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trainguard.step.capturer import unwrap

logger = logging.getLogger(__name__)


@dataclass
class _Slot:
    """One buffer of the model: where it lives and how it looked at the step's start."""

    name: str
    module: nn.Module
    key: str
    persistent: bool
    tensor: Tensor | None = None
    version: int = -1

    def current(self) -> Tensor | None:
        found = self.module._buffers.get(self.key)
        return found if isinstance(found, Tensor) else None

    def mark(self) -> None:
        self.tensor = self.current()
        self.version = _version(self.tensor)

    def changed(self) -> bool:
        now = self.current()
        return now is not self.tensor or _version(now) != self.version


def _version(tensor: Tensor | None) -> int:
    if tensor is None:
        return -1
    try:
        return int(tensor._version)
    except RuntimeError:  # inference tensors have no version counter
        return -1


class BufferKeeper:
    """Copies at a step's start the buffers its forward changes; puts them back on a skip."""

    def __init__(self, model: nn.Module) -> None:
        self._slots = [
            _Slot(name, owner, key, key not in owner._non_persistent_buffers_set)
            for name, owner, key in _buffers(model)
        ]
        self._tracked: set[int] = set()
        """Indices of the buffers some step's forward changed (all, before the first step)."""
        self._learned = False
        self._copies: list[dict[int, Tensor]] = [{}, {}]
        self._steps = [-1, -1]
        """The step each of the two copies belongs to."""
        self._turn = 0
        self._open = False
        self.uncopied: list[str] = []
        """Buffers the last decided step changed without a copy (``learn``)."""

    @property
    def enabled(self) -> bool:
        return bool(self._slots)

    def begin(self, step: int) -> None:
        """The step's first forward is about to run: copy what its forward may change."""
        if not self._slots:
            return
        self._turn ^= 1
        self._steps[self._turn] = step
        copies = self._copies[self._turn]
        indices = self._tracked if self._learned else range(len(self._slots))
        refresh = _Refresh()
        for index in indices:
            slot = self._slots[index]
            slot.mark()
            if slot.tensor is None:
                copies.pop(index, None)
                continue
            copies[index] = refresh.into(copies.get(index), slot.tensor)
        refresh.run()
        for index in set(copies) - set(indices):
            del copies[index]
        if self._learned:
            for index in range(len(self._slots)):
                if index not in self._tracked:
                    self._slots[index].mark()
        self._open = True

    def learn(self, step: int) -> list[str]:
        """At step ``step``'s decision: note which buffers it changed. Returns the names of
        those changed without a copy (first written at this step): a skip cannot put them
        back."""
        self.uncopied = []
        if not self._open or self._steps[self._turn] != step:
            return []
        self._open = False
        copies = self._copies[self._turn]
        changed = [i for i, slot in enumerate(self._slots) if self._changed(i, slot, copies)]
        owners = {id(self._slots[i].module) for i in changed}
        # A module's buffers go together: native kernels (BatchNorm's running statistics)
        # write without bumping the version counter, while its ``num_batches_tracked`` does.
        grouped = [i for i, slot in enumerate(self._slots) if id(slot.module) in owners]
        uncopied = [self._slots[i].name for i in changed if i not in copies]
        self._tracked.update(grouped)
        self._learned = True
        self.uncopied = uncopied
        return uncopied

    def _changed(self, index: int, slot: _Slot, copies: dict[int, Tensor]) -> bool:
        if slot.changed():
            return True
        if self._learned or index not in copies:
            return False
        # The first step: compare values too (a write that bumped no version counter).
        now = slot.current()
        return now is not None and not torch.equal(now, copies[index])

    def restore(self, step: int) -> list[str]:
        """Put step ``step``'s changed buffers back as they were at its start (host
        decision); nothing when that step's start was not recorded."""
        restored: list[str] = []
        if self._steps[self._turn] != step:
            return restored
        for index, saved in self._copies[self._turn].items():
            slot = self._slots[index]
            now = slot.current()
            if now is not slot.tensor or now is None or not torch.equal(now, saved):
                _put_back(slot, saved)
                restored.append(slot.name)
        return restored

    def restore_where(self, flag: Tensor, step: int) -> None:
        """On the device: put step ``step``'s tracked buffers back where ``flag`` (a 0-d
        tensor) is non-zero, keep them otherwise. No host read (the sync-free step)."""
        if self._steps[self._turn] != step:
            return
        bad_on: dict[torch.device, Tensor] = {}  # the flag compared once per device
        with torch.no_grad():
            for index, saved in self._copies[self._turn].items():
                now = self._slots[index].current()
                if now is None or now.shape != saved.shape or now.dtype != saved.dtype:
                    continue
                bad = bad_on.get(now.device)
                if bad is None:
                    bad = bad_on[now.device] = flag.to(now.device, non_blocking=True) > 0
                torch.where(bad, saved, now, out=now)  # one launch a buffer, in place

    def pre_step(self, step: int) -> dict[str, Tensor]:
        """The persistent buffers step ``step`` changed, as they were at its start (state-dict
        names of the unwrapped model), for a capture: the step in progress or the one before
        (empty when neither is ``step``)."""
        if step not in self._steps:
            return {}
        copies = self._copies[self._steps.index(step)]
        return {
            self._slots[i].name: saved for i, saved in copies.items() if self._slots[i].persistent
        }


def _buffers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """Every buffer as (state-dict name, owning module, key), wrappers' prefixes removed."""
    inner = unwrap(model)
    found: list[tuple[str, nn.Module, str]] = []
    seen: set[int] = set()
    for prefix, module in inner.named_modules(remove_duplicate=True):
        for key, tensor in module._buffers.items():
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            found.append((f"{prefix}.{key}" if prefix else key, module, key))
    return found


class _Refresh:
    """The start's copies into the stores of the step before: one ``_foreach_copy_`` per
    device and dtype (a BatchNorm net: two launches, not one per buffer)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]]
        self._groups = {}

    def into(self, store: Tensor | None, tensor: Tensor) -> Tensor:
        """The store ``tensor`` will be copied into by ``run`` (a fresh copy when none fits)."""
        if store is None or store.shape != tensor.shape or store.dtype != tensor.dtype:
            return _fresh_copy(tensor)
        if store.device != tensor.device:
            return _fresh_copy(tensor)
        stores, tensors = self._groups.setdefault((tensor.device, tensor.dtype), ([], []))
        stores.append(store)
        tensors.append(tensor)  # read under no_grad (run): no detach op
        return store

    def run(self) -> None:
        with torch.no_grad():
            for stores, tensors in self._groups.values():
                torch._foreach_copy_(stores, tensors)


def _fresh_copy(tensor: Tensor) -> Tensor:
    with torch.no_grad():
        return tensor.detach().clone()


def _put_back(slot: _Slot, saved: Tensor) -> None:
    """Write ``saved`` into the buffer in place (DDP keeps references to the buffers), or
    put a copy of it in place of a replacement tensor of another shape or dtype."""
    now = slot.current()
    with torch.no_grad():
        if now is not None and now.shape == saved.shape and now.dtype == saved.dtype:
            now.copy_(saved)
        else:
            slot.module._buffers[slot.key] = saved.clone()
