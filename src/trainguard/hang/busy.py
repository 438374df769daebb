"""Work between steps on another module is progress: an EMA copy evaluated on one rank.

The hang rule counts the loop's progress (``Progress.beats``): a batch fetched, a forward of
the guarded model (training, or an evaluation through it: ``StepStart.on_evaluation``), a
check. Rank 0 evaluating *another* module alone while the others wait in the next step's
collective (an EMA copy made before the guard, a separate eval model, a sampler running a
diffusion model's EMA for minutes) made none, and a healthy job was ended as a hang once
the evaluation outlasted the timeout. ``guard.phase("eval")`` is the fix a script can make;
an unmodified script (``trainguard run``) cannot.

``BusyProbe`` watches for such work at no cost to the training step. Nothing is installed
while the loop makes progress. Once it has made none for ``record_after(timeout)`` (a
quarter of the timeout: the watchdog's tick calls ``arm``), one process-wide forward
pre-hook goes in (``register_module_forward_pre_hook``). The next forward, on the loop's
thread, of a module that is not the guarded model or part of it, is work: the hook counts a
*busy* beat (``Progress.busy``) and takes itself out; the watchdog arms it again after
another quarter without progress, so a long evaluation beats about four times per timeout.
A forward of the guarded model itself takes the hook out without a beat: the loop is back,
and its own hooks mark that.

What it does not see, and stays a hang past the timeout: work without a module forward on
the loop's thread (a save through another writer than ``torch.save``, metrics computed in
NumPy: ``guard.phase`` marks those); a forward on another thread; a forward inside a
compiled region (the hook does nothing while dynamo traces; the compiled wrapper's own
call, eager, is seen).

A stretch ended by busy beats alone, and the one after it, are not fed to the timeout's
learner (``timeout.StallMeter``), as user phases are not: an evaluation does not teach the
learner that the loop may stand still that long. A rank stuck in a collective runs no forward, so
a real hang is still declared after the timeout.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from trainguard.hang.progress import Progress


class BusyProbe:
    """Arms a one-shot process-wide forward pre-hook that tells work on other modules."""

    def __init__(self, progress: Progress, model: nn.Module, thread: int | None = None) -> None:
        self._progress = progress
        self._own = frozenset(id(m) for m in model.modules())
        """The guarded model and everything inside it: their forwards are the loop's own."""
        self._thread = threading.get_ident() if thread is None else thread
        self._handle: RemovableHandle | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self) -> None:
        """Install the hook (the watchdog's thread, after a quarter timeout without progress);
        nothing when already armed or closed."""
        with self._lock:
            if self._handle is None and not self._closed:
                self._handle = register_module_forward_pre_hook(self._forward)

    def disarm(self) -> None:
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()

    def close(self) -> None:
        self._closed = True
        self.disarm()

    def _forward(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or threading.get_ident() != self._thread:
            return None
        self.disarm()
        if id(module) not in self._own:
            self._progress.busy()
        return None
