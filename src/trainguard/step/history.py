"""The per-step record and the bounded ring of recent steps (written into capture bundles).

After each step's decision is read on the host, the guard makes one small record from values
it already holds: the step, every rank's loss and the global gradient norm before clipping
(both from the agreement, so identical on every rank), the decision, the learning rate of
``param_groups[0]``, the host time since the previous record and every rank's data and
compute seconds (``health.timing``, also agreed; in the metrics log only). No device sync and no
collective: with the sync-free ``step()`` a step's record is made when its flags are read,
one step later. The ring keeps the last ``GuardConfig.history_steps`` records; a capture
writes them as the bundle's ``history.json`` (``bundle_history``), the bad step last.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainguard.step.hyperparams import recorded_lrs
from trainguard.step.metrics_log import MetricsLog
from trainguard.step.types import Agreement, Decision

LOGGED_RANKS = 64
"""Up to this many ranks the metrics log holds every rank's loss; past it (a line would grow
to kilobytes per step) a ``loss_summary`` instead: min, mean, max and the non-finite ranks."""

HISTORY_FORMAT = 1
"""Version of ``history.json``: ``{"format": 1, "records": [{step, losses, grad_norm,
decision, lr}, ...]}``, oldest first."""


@dataclass(slots=True)
class StepRecord:
    """One checked step as the guard saw it (not changed once made: the metrics log builds
    its line from it later; not frozen only because a frozen init costs a step more)."""

    step: int
    losses: list[float]
    """Every rank's loss (agreed: the same list on every rank)."""
    grad_norm: float
    """The global gradient norm before clipping (``inf`` when a gradient is not finite)."""
    decision: str
    lr: float | None
    """``param_groups[0]["lr"]`` when the record was made (None when not a plain number)."""
    step_seconds: float | None
    """Host seconds since the previous record (None for the first)."""
    time: float
    """Unix time of the record."""
    data_times: list[float] = field(default_factory=list)
    """Every rank's seconds waiting for its data in the step (empty: not timed)."""
    compute_times: list[float] = field(default_factory=list)
    """Every rank's seconds of its own compute (forward) in the step (empty: not timed)."""
    lrs: list[float | None] | None = None
    """Every param group's learning rate (``hyperparams.recorded_lrs``); None with one group
    (``lr`` is it)."""

    def bundle_fields(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "losses": list(self.losses),
            "grad_norm": self.grad_norm,
            "decision": self.decision,
            "lr": self.lr,
            "lrs": list(self.lrs) if self.lrs is not None else [self.lr],
        }

    def log_line(self) -> str | None:
        """The metrics log line of a one-rank record whose numbers are finite floats, formatted
        directly: the text ``json`` gives ``log_fields()`` (a float as its ``repr``), at about
        half the cost, which a world of one pays at every step. None for any other record
        (then the log encodes ``log_fields()``)."""
        losses = self.losses
        decision = self.decision
        if len(losses) > 1 or not (decision.isascii() and decision.isalpha()):
            return None
        if type(self.step) is not int or self.lrs is not None:  # the encoder's way
            return None
        numbers: tuple[Any, ...] = (*losses, self.grad_norm, self.lr, self.step_seconds, self.time)
        if set(map(type, numbers)) != {float} or not math.isfinite(sum(numbers)):
            return None  # None (lr, step_seconds), an int, NaN/Inf: the encoder's way
        timing = _one_rank_timing(self.data_times, self.compute_times)
        if timing is None:
            return None
        loss = f"[{losses[0]!r}]" if losses else "[]"
        return (
            f'{{"step": {self.step}, "losses": {loss}, "grad_norm": {self.grad_norm!r}, '
            f'"decision": "{self.decision}", "lr": {self.lr!r}, '
            f'"step_seconds": {self.step_seconds!r}, "time": {self.time!r}{timing}}}'
        )

    def log_fields(self) -> dict[str, Any]:
        """The metrics log line: past ``LOGGED_RANKS`` ranks the losses are summarized."""
        many = len(self.losses) > LOGGED_RANKS
        fields: dict[str, Any] = {  # bundle_fields' keys first, in its order
            "step": self.step,
            "losses": None if many else list(self.losses),
            "grad_norm": self.grad_norm,
            "decision": self.decision,
            "lr": self.lr,
            "step_seconds": self.step_seconds,
            "time": self.time,
        }
        if self.lrs is not None:
            fields["lrs"] = list(self.lrs)
        if many:
            fields["loss_summary"] = loss_summary(self.losses)
        if any(self.data_times) or any(self.compute_times):  # timed: timing_fields
            fields.update(timing_fields(self.data_times, self.compute_times))
        return fields


def _one_rank_timing(data_times: list[float], compute_times: list[float]) -> str | None:
    """``timing_fields`` of one rank as ``StepRecord.log_line`` writes it: "" when not timed,
    None when the times are not one float each."""
    if not data_times and not compute_times:
        return ""
    if len(data_times) != 1 or len(compute_times) != 1:
        return None
    data, compute = data_times[0], compute_times[0]
    if type(data) is not float or type(compute) is not float:
        return None
    if not (data or compute):
        return ""
    return f', "data_times": [{round(data, 6)!r}], "compute_times": [{round(compute, 6)!r}]'


def timing_fields(data_times: list[float], compute_times: list[float]) -> dict[str, Any]:
    """``data_times`` / ``compute_times`` (seconds, to the microsecond) when the step was timed;
    past ``LOGGED_RANKS`` ranks a ``time_summary`` of each phase instead."""
    if not (any(data_times) or any(compute_times)):
        return {}  # not timed (detect_stragglers=False)
    if len(data_times) > LOGGED_RANKS:
        return {
            "time_summary": {
                "data": time_summary(data_times),
                "compute": time_summary(compute_times),
            }
        }
    return {
        "data_times": [round(t, 6) for t in data_times],
        "compute_times": [round(t, 6) for t in compute_times],
    }


def time_summary(times: list[float]) -> dict[str, Any]:
    """The median and the slowest rank of one phase's per-rank seconds."""
    slowest = max(range(len(times)), key=times.__getitem__)
    return {
        "median": round(sorted(times)[(len(times) - 1) // 2], 6),
        "max": round(times[slowest], 6),
        "max_rank": slowest,
    }


def loss_summary(losses: list[float]) -> dict[str, Any]:
    """min / mean / max over the finite losses, and the ranks whose loss is not finite."""
    finite = [v for v in losses if math.isfinite(v)]
    return {
        "min": min(finite) if finite else None,
        "mean": sum(finite) / len(finite) if finite else None,
        "max": max(finite) if finite else None,
        "nonfinite_ranks": [r for r, v in enumerate(losses) if not math.isfinite(v)],
    }


class StepHistory:
    """The ring of the last ``capacity`` step records; forwards each to the metrics log."""

    def __init__(self, capacity: int, metrics: MetricsLog | None = None) -> None:
        self._ring: deque[StepRecord] = deque(maxlen=capacity)
        self._metrics = metrics
        self._last_clock: float | None = None
        self.lr_factor: Callable[[int], float] | None = None
        """Recovery's LR backoff factor of a step (``Recovery.lr_factor``), None without
        recovery: a record's ``lr`` is the one the optimizer step uses, the schedule's value
        times the factor (the optimizer hook scales it only around ``step()``)."""

    def record(
        self,
        step: int,
        agreement: Agreement,
        decision: Decision,
        optimizer: torch.optim.Optimizer,
        loss_known: bool = True,
    ) -> StepRecord:
        """Record a step whose decision was just read (host values only); a decision other
        than ``"ok"`` is written out at once. ``loss_known`` False
        (``Guard.check_gradients``): the record holds no loss, rather than a made-up one. The
        learning rates are this rank's, as its optimizer step uses them (a record, not a
        decision: the rules read ``Agreement.lr``)."""
        now = time.perf_counter()
        last, self._last_clock = self._last_clock, now
        lr, lrs = recorded_lrs(optimizer)
        factor = self.lr_factor
        if factor is not None and lr is not None:
            scale = factor(step)
            lr *= scale
            if lrs is not None:
                lrs = [None if x is None else x * scale for x in lrs]
        label: str = decision._value_  # ``.value`` is a descriptor: two calls a step
        rec = StepRecord(
            step,
            list(agreement.losses) if loss_known else [],
            agreement.grad_norm,
            label,
            lr,
            None if last is None else now - last,
            time.time(),
            agreement.data_times,
            agreement.compute_times,
            lrs,
        )
        self._ring.append(rec)
        metrics = self._metrics
        if metrics is not None:
            metrics.add(rec, urgent=label != "ok")  # fields built at the flush
        return rec

    def records(self) -> list[StepRecord]:
        """The ring, oldest first."""
        return list(self._ring)

    def last(self) -> StepRecord | None:
        """The newest record (None before the first decided step); no copy of the ring."""
        return self._ring[-1] if self._ring else None

    def bundle_history(self) -> dict[str, Any]:
        """The content of a bundle's ``history.json`` (before ``to_jsonable``)."""
        return {"format": HISTORY_FORMAT, "records": [r.bundle_fields() for r in self._ring]}

    def flush(self) -> None:
        if self._metrics is not None:
            self._metrics.flush()

    def flush_if_stale(self) -> None:
        """The metrics log's lines that waited a second, written (``MetricsLog.flush_if_stale``:
        the hang watchdog's thread calls it every tick)."""
        if self._metrics is not None:
            self._metrics.flush_if_stale()

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
