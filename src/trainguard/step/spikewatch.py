"""The spike policy of a Guard: judge each agreed step, write ``spike`` events, decide.

``on_spike``: ``"warn"`` lets the step through with an event; ``"skip"`` skips the update
(like a non-finite step) and escalates after ``spike_max_consecutive`` spikes in a row;
``"rollback"`` escalates at once (the guard then does what ``on_escalation`` says);
``"off"`` judges nothing. The rule itself is in ``spikes.py``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainguard.config import SpikeConfig
from trainguard.errors import SpikeError
from trainguard.events import EventLog
from trainguard.step.consensus import Consensus
from trainguard.step.deferred import HostStager
from trainguard.step.spikes import (
    METRICS,
    DeviceSpikeDetector,
    Spike,
    SpikeDetector,
    SpikeRule,
)
from trainguard.step.types import Agreement, Decision, Reduced

logger = logging.getLogger(__name__)

Staged = tuple[Tensor, "torch.cuda.Event | None"]
"""A verdict copied (or being copied) to the host, and the event that says it is there."""


def staged_verdict(staged: Staged) -> list[list[float]]:
    """The device rule's verdict of a step (``SpikeWatch.on_device``), read on the host a
    step late (``SpikeWatch.read`` decides from it)."""
    host, ready = staged
    if ready is not None:
        ready.synchronize()
    verdict: list[list[float]] = host.tolist()
    return verdict


def rule_of(config: SpikeConfig) -> SpikeRule:
    return SpikeRule(
        z_threshold=config.z, ratio=config.ratio, beta=config.beta, warmup=config.warmup
    )


class SpikeWatch:
    """Judges spikes for one Guard; the same verdicts on every rank (agreed values only)."""

    def __init__(self, config: SpikeConfig, events: EventLog, rank: int) -> None:
        self.action = config.action
        self.max_consecutive = config.max_consecutive
        self.rule = rule_of(config)
        self.detector = SpikeDetector(self.rule)
        self._device: DeviceSpikeDetector | None = None
        self._device_grace: list[float] = [0.0, 0.0]
        """The device rule's LR grace (``DeviceSpikeDetector.grace``) loaded before the
        device detector exists."""
        self._stager = HostStager()
        self._events = events
        self._rank = rank
        self._device_state: list[list[float]] | None = None
        """Device statistics loaded before the device detector exists."""
        self.consecutive = 0
        """Spikes in a row ending at the last judged step."""
        self.total = 0

    @property
    def enabled(self) -> bool:
        return self.action != "off"

    @property
    def skips_on_device(self) -> bool:
        """Whether a spike must stop the update (folded into ``found_inf``)."""
        return self.action in ("skip", "rollback")

    # -- check(): host floats ------------------------------------------------------------

    def judge(self, agreement: Agreement, step: int) -> Decision | None:
        """A finite, agreed step: None (go on), ``SPIKE`` (skip it) or ``ESCALATE``. From
        the agreed values: the mean loss, the global gradient norm and the learning rate
        (``Agreement.lr``), never a rank's own learning rate: the ranks would judge apart
        exactly when one rank's LR went wrong."""
        if self.action == "off":  # not ``enabled``: a call less on every step
            return None
        detector = self.detector
        judging = detector.grace.judging(agreement.lr)
        known = agreement.mean_loss if agreement.loss_known else None  # a rank saw none
        loss = detector.observe_one("loss", known, judging)
        norm = detector.observe_one("grad_norm", agreement.grad_norm, judging)
        if loss is None and norm is None:  # the usual case
            self.consecutive = 0
            return None
        return self._decide([s for s in (loss, norm) if s is not None], step)

    # -- the sync-free step: device tensors ------------------------------------------------

    def on_device(self, consensus: Consensus, reduced: Reduced, found_inf: Tensor) -> Staged | None:
        """Judge the step on the device, fold a skipping spike into ``found_inf`` (in place)
        and start copying the verdict to the host; no host read.

        Only when a spike must stop the update (``"skip"``, ``"rollback"``): the device rule
        costs some 60 small ops a step. Otherwise (None) the host judges the agreed values
        when it reads them, a step late, at no device cost."""
        if not self.skips_on_device:
            return None
        values = consensus.agreed_metrics(reduced)
        bad = found_inf.to(values.device, non_blocking=True) > 0  # a bad step is not learned
        values = torch.where(bad, torch.full_like(values, math.nan), values)
        if self._device is None:
            self._device = DeviceSpikeDetector(self.rule, values.device)
            if self._device_state is not None:
                self._device.stats.copy_(torch.tensor(self._device_state, dtype=torch.float64))
            self._device.grace.copy_(torch.tensor(self._device_grace, dtype=torch.float64))
        verdict = self._device.observe(values, consensus.agreed_lr(reduced))
        if self.skips_on_device:
            spike = verdict[:, 0].amax().to(found_inf.device, found_inf.dtype, non_blocking=True)
            torch.maximum(found_inf, spike, out=found_inf)
        return self._stager.stage(verdict)

    def read(self, verdict: list[list[float]], step: int) -> Decision | None:
        """The device verdict read on the host (a step late): events and the decision."""
        spikes = [
            Spike(metric, value, baseline, score, self.rule.z_threshold, value / baseline)
            for metric, (flag, value, baseline, score) in zip(METRICS, verdict, strict=True)
            if flag > 0.5
        ]
        return self._decide(spikes, step)

    # -- state (in GuardState's state_dict: rollback and resume restore it) -----------------

    def state_dict(self) -> dict[str, Any]:
        """The rule's statistics. Under the sync-free step with a device rule, this reads its
        six numbers from the device (a host sync, no collective)."""
        device, grace = self._device_state, self._device_grace
        if self._device is not None:
            device, grace = self._device.stats.tolist(), self._device.grace.tolist()
        return {
            "detector": self.detector.state_dict(),
            "device": device,
            "device_grace": [grace[0] or None, int(grace[1])],
            "consecutive": self.consecutive,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["detector"])
        self._device_state = state["device"]
        if self._device is not None and self._device_state is not None:
            stats = torch.tensor(self._device_state, dtype=torch.float64)
            self._device.stats.copy_(stats)
        lr, left = state["device_grace"]
        self._device_grace = [float(lr or 0.0), float(left)]
        if self._device is not None:
            self._device.grace.copy_(torch.tensor(self._device_grace, dtype=torch.float64))
        self.consecutive = int(state["consecutive"])

    # -- the policy -------------------------------------------------------------------------

    def _decide(self, spikes: list[Spike], step: int) -> Decision | None:
        if not spikes:
            self.consecutive = 0
            return None
        self.consecutive += 1
        self.total += 1
        decision = self._action()
        for spike in spikes:
            self._events.write(
                "spike",
                step,
                **spike.fields(),
                action=decision.value if decision is not None else "warn",
                consecutive=self.consecutive,
            )
        log = logger.warning if self._rank == 0 else logger.debug
        for spike in spikes:
            log(
                "trainguard: step %d %s spike: %.4g vs baseline %.4g (x%.1f, z=%.1f): %s",
                step,
                spike.metric,
                spike.value,
                spike.baseline,
                spike.ratio,
                spike.score,
                decision.value if decision is not None else "warn",
            )
        return decision

    def _action(self) -> Decision | None:
        if self.action == "warn":
            return None
        if self.action == "rollback" or self.consecutive >= self.max_consecutive:
            return Decision.ESCALATE
        return Decision.SPIKE

    def error(self, step: int, bundle: Path | None = None) -> SpikeError:
        """The error of an escalation (on every rank)."""
        message = (
            f"step {step}: {self.consecutive} loss/gradient-norm spike(s) in a row "
            f"(on_spike={self.action!r}, spikes.max_consecutive={self.max_consecutive})"
        )
        self._events.write("escalate", step, reason="spike", consecutive=self.consecutive)
        return SpikeError(message, step=step, ranks=[], bundle=bundle)
