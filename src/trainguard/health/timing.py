"""Per rank and step: how long it waited for data, and how long its own compute took.

*Data*: the time inside ``watch()`` fetching batches from the loader (``data_started`` /
``data_ended`` around each fetch).

*Compute*: the time of the rank's forward passes, timed by a forward pre-hook and a forward
hook on the module inside its wrappers. Why the forward and not forward + backward: under DDP
the backward waits in the gradient all-reduce for the slowest rank, so a healthy rank's
backward is as long as the straggler's and would hide it; the forward of the inner module
(not the DDP wrapper, whose forward first broadcasts buffers, also a wait) involves no other
rank. A rank whose device is slower is slower in its forward too. Time spent waiting for
other ranks is therefore counted nowhere. Host clock (``time.perf_counter``); on CUDA the
forward's host time is its launch time unless the step syncs, which the decision does once
per step (the timing then lands in the step that waits). Under ``torch.compile`` the hooks go
where they run eagerly (``user_hooks.eager_module``): on the compile wrapper inside DDP, or
around a module compiled in place; a wrapper compiled around DDP itself
(``torch.compile(DDP(model))``) is timed whole, its buffer broadcast included.

In a single process (``forward_hooks=False``: no other rank to wait for, no straggler to
find) no module hook is set, since a hook sends every call of the module down PyTorch's slow
call path; *compute* is then the step's host time outside the data fetch: from the last
``take()`` to this one, less the data time (forward, backward, the update and the loop's
own work).
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from trainguard.user_hooks import HookHandle, add_forward_hooks


class StepTimer:
    """Accumulates one step's data and compute seconds; ``take()`` hands them over."""

    def __init__(self, inner: nn.Module, forward_hooks: bool = True) -> None:
        self._data = 0.0
        self._compute = 0.0
        self._data_since: float | None = None
        self._forward_since: float | None = None
        self._depth = 0
        self._hooked = forward_hooks
        self._last_take: float | None = None
        self._handles: list[HookHandle] = (
            [add_forward_hooks(inner, pre=self._before_forward, post=self._after_forward)]
            if forward_hooks
            else []
        )

    def data_started(self) -> None:
        self._data_since = time.perf_counter()

    def data_ended(self) -> None:
        if self._data_since is not None:
            self._data += time.perf_counter() - self._data_since
            self._data_since = None

    def _before_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            self._forward_since = time.perf_counter()

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._forward_since is not None:
            self._compute += time.perf_counter() - self._forward_since
            self._forward_since = None

    def take(self) -> tuple[float, float]:
        """``(data seconds, compute seconds)`` since the last call; starts a new step."""
        data, compute = self._data, self._compute
        self._data = self._compute = 0.0
        if not self._hooked:  # one process: the step's time outside the fetch
            now = time.perf_counter()
            last, self._last_take = self._last_take, now
            compute = max(0.0, now - last - data) if last is not None else 0.0
        return data, compute

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
