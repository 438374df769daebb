"""``guard.metrics()``: the guard's per-step numbers as one flat dict for any logger.

Every key starts with ``trainguard/``; the values are host ``int`` / ``float`` numbers:

- ``step``: optimizer steps the guard has counted (``guard.state.step``: the next step's
  number; after ``check()`` of step N it is N + 1);
- ``skipped_steps``: steps whose update was not applied: non-finite steps plus spikes that
  were skipped or rolled back (``on_spike="skip"`` / ``"rollback"``);
- ``nonfinite_steps``: the non-finite steps among them (``state.total_nonfinite``);
- ``consecutive_bad``: non-finite steps in a row ending at the last decided step (the
  counter ``max_consecutive`` escalates on; after a rollback still the escalating step's
  count, until the next step is decided);
- ``loss``: the last decided step's loss, the mean over the ranks (NaN/Inf when it was not
  finite); absent before the first decided step, and when the guard has no loss
  (``trainguard run`` checks the gradients only);
- ``grad_norm``: the last decided step's global gradient norm before clipping (Inf when a
  gradient was not finite); absent before the first decided step;
- ``spikes``: steps with a loss or grad-norm spike (whatever ``on_spike`` did with them; a
  step where both spike counts once, and has a ``spike`` event per metric); cumulative, kept
  through rollbacks and resumes;
- ``rollbacks``: rollbacks to a known-good snapshot or checkpoint (0 without recovery);
- ``lr_factor``: recovery's LR backoff factor on the schedule for the last decided step's
  update (its ``optimizer.step()``; 1.0 when none), beside that step's loss and grad norm;
  after a rollback, the factor the restored step runs with;
- ``loss_scale`` and ``overflow_steps``: with a GradScaler only: its scale and the fp16
  steps it skipped for overflow;
- ``stragglers``: ranks named stragglers now (in either phase, data or compute);
- ``replica_divergences``: checks that found the replicas' weights differing.

Cost: no collective and no device sync. Every value is a host number the guard already
holds, read from the agreed data of the decided steps, so every rank returns the same dict.
The one device value, a GradScaler's scale on a GPU, is copied to the host without blocking
(pinned memory, an event): each call returns the scale of an earlier call and starts the next
copy (``loss_scale`` is absent until the first copy has landed). With the sync-free
``guard.step()`` (fused optimizer) the host reads a step's outcome during the next step, so
``loss``, ``grad_norm`` and the counters are one step behind ``step``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from trainguard.health.replicas import ReplicaWatch
from trainguard.health.stragglers import StragglerWatch
from trainguard.recovery import Recovery
from trainguard.step.deferred import HostStager
from trainguard.step.history import StepHistory
from trainguard.step.spikewatch import SpikeWatch
from trainguard.step.state import GuardState

PREFIX = "trainguard/"

KEYS = (
    "step",
    "skipped_steps",
    "nonfinite_steps",
    "consecutive_bad",
    "loss",
    "grad_norm",
    "spikes",
    "rollbacks",
    "lr_factor",
    "loss_scale",
    "overflow_steps",
    "stragglers",
    "replica_divergences",
)
"""Every key ``guard.metrics()`` may hold, without the prefix (``loss``/``grad_norm`` from the
first decided step on; ``loss_scale``/``overflow_steps`` with a GradScaler)."""


class DashboardSource(Protocol):
    """What the dashboard reads from the Guard (its public parts)."""

    state: GuardState
    history: StepHistory
    spikes: SpikeWatch
    recovery: Recovery | None
    scaler: Any
    stragglers: StragglerWatch
    replicas: ReplicaWatch


class Dashboard:
    """Builds ``guard.metrics()`` from the guard's parts, at the caller's pace."""

    def __init__(self, guard: DashboardSource) -> None:
        self._guard = guard
        self._scale = ScaleReader()

    def read(self) -> dict[str, float | int]:
        guard = self._guard
        state, spikes = guard.state, guard.spikes
        spike_skips = spikes.total if spikes.skips_on_device else 0
        out: dict[str, float | int] = {
            "trainguard/step": state.step,
            "trainguard/skipped_steps": state.total_nonfinite + spike_skips,
            "trainguard/nonfinite_steps": state.total_nonfinite,
            "trainguard/consecutive_bad": state.last_streak,
        }
        last = guard.history.last()
        if last is not None:
            losses = last.losses
            if losses:  # none recorded: the loss is unknown (``Guard.check_gradients``)
                out["trainguard/loss"] = sum(losses) / len(losses)
            out["trainguard/grad_norm"] = last.grad_norm
        recovery = guard.recovery
        out["trainguard/spikes"] = spikes.total
        out["trainguard/rollbacks"] = recovery.state.rollbacks if recovery is not None else 0
        out["trainguard/lr_factor"] = recovery.lr.current() if recovery is not None else 1.0
        if guard.scaler is not None:
            scale = self._scale.read(guard.scaler)
            if scale is not None:
                out["trainguard/loss_scale"] = scale
            out["trainguard/overflow_steps"] = state.overflow_steps
        named = guard.stragglers.current
        out["trainguard/stragglers"] = len({r for ranks in named.values() for r in ranks})
        out["trainguard/replica_divergences"] = guard.replicas.divergences
        return out


class ScaleReader:
    """A GradScaler's scale as a host float without a device sync.

    On the CPU (or before the scaler made its scale tensor) it is read directly. On a GPU the
    scale is copied to pinned host memory without blocking and read at a later call, once the
    copy's event says it has landed; meanwhile the last landed value is returned."""

    def __init__(self) -> None:
        self._stager = HostStager()
        self._pending: tuple[Tensor, torch.cuda.Event | None] | None = None
        self._value: float | None = None

    def read(self, scaler: Any) -> float | None:
        is_enabled = getattr(scaler, "is_enabled", None)
        if callable(is_enabled) and not is_enabled():
            return None
        scale = getattr(scaler, "_scale", None)  # GradScaler's scale tensor (private, stable)
        if not isinstance(scale, Tensor):
            get_scale = getattr(scaler, "get_scale", None)  # not made yet: the init scale
            return float(get_scale()) if callable(get_scale) else None
        if scale.device.type != "cuda":
            return float(scale.item())  # a host tensor: no device sync
        pending = self._pending
        if pending is not None:
            host, ready = pending
            if ready is None or ready.query():  # type: ignore[no-untyped-call]
                self._value = float(host.item())  # pinned host memory, the copy is done
                pending = None
        if pending is None:
            self._pending = self._stager.stage(scale.detach().reshape(1))
        return self._value
