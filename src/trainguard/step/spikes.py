"""Loss and gradient-norm spikes, judged from the values the step's all-reduce already carries.

Two metrics per step, both agreed by every rank: the loss (the mean over ranks of each
rank's reported loss) and the global gradient norm *before* clipping. Every rank runs the
same deterministic update on the same agreed values, so every rank decides the same; no
extra collective.

The rule, per metric, on ``x = log(value)`` (a spike is multiplicative: grad norms move
10-1000x over a run, so absolute thresholds fail both early and late):

* running statistics: an exponential moving mean ``m`` and variance ``v`` with weight
  ``a_n = max(1 - beta, 1 / n)`` for the n-th value. ``1 / n`` is the exact running mean
  and variance, so the first values are not biased towards the zero start (the bias
  correction); after ``1 / (1 - beta)`` values it is an EMA of memory ``1 / (1 - beta)``.
* the score: ``z = (x - m) / max(sqrt(v), SIGMA_FLOOR)``, one-sided (only upward moves).
* a spike: ``z > z_threshold`` AND ``value / exp(m) > ratio`` (the ratio floor: a very
  quiet metric never flags a tiny relative blip) AND at least ``warmup`` values seen AND
  not within ``grace`` steps after the host saw the learning rate jump up.
* the update (every finite step, spikes included) is winsorised: the residual ``r = x - m``
  is clamped to ``+-CLAMP_SIGMAS * sigma`` before ``m += a r`` and ``v = (1 - a)(v + a r^2)``.
  A single spike therefore moves ``m`` and ``v`` no more than a 3-sigma value does, so it
  cannot inflate sigma and hide the next spikes (the failure of windowed z-scores that take
  the spike in); a real level change still moves ``m`` and grows ``sigma`` geometrically (by
  ``sqrt(beta + (1 - beta) CLAMP_SIGMAS^2)`` per step) until it is absorbed (the failure of
  rules that only learn from non-spike steps, which lock out a new level forever).

State: three numbers per metric (O(1)). The sync-free ``guard.step()`` runs the same rule on
the device (``DeviceSpikeDetector``, float64 tensors, no host read); ``check()`` uses host
floats, since it reads the agreement anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

CLAMP_SIGMAS = 3.0
"""Residuals are clamped to this many sigmas before they update the statistics."""
SIGMA_FLOOR = 0.01
"""The smallest sigma (in log space, ~1%) a value is judged against and clamped by."""
LR_JUMP = 1.1
"""A learning rate above this factor times the last one starts the grace period."""
METRICS = ("loss", "grad_norm")


@dataclass(frozen=True)
class SpikeRule:
    """The knobs (``GuardConfig.spikes``; ``grace``: fixed)."""

    z_threshold: float = 6.0
    ratio: float = 2.0
    beta: float = 0.98
    warmup: int = 100
    grace: int = 50


@dataclass(frozen=True)
class Spike:
    """One metric judged a spike at one step."""

    metric: str
    value: float
    baseline: float
    """``exp(m)``: the running (geometric) mean the value was judged against."""
    score: float
    """The z-score in log space."""
    threshold: float
    ratio: float
    """``value / baseline``."""

    def fields(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "value": self.value,
            "baseline": self.baseline,
            "score": self.score,
            "threshold": self.threshold,
            "ratio": self.ratio,
        }


@dataclass
class LogEma:
    """Bias-corrected, winsorised EMA mean and variance of log-values (host floats); updated
    by ``SpikeDetector.observe_one``."""

    count: int = 0
    mean: float = 0.0
    var: float = 0.0


class LrGrace:
    """No judging for ``steps`` steps after the learning rate jumps up (a warm restart)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.lr: float | None = None
        self.left = 0

    def judging(self, lr: float | None) -> bool:
        """Note this step's learning rate; False while in the grace period after a jump."""
        if lr is not None:
            if self.lr is not None and lr > self.lr * LR_JUMP:
                self.left = self.steps
            self.lr = lr
        if self.left > 0:
            self.left -= 1
            return False
        return True


class SpikeDetector:
    """Judges each step's agreed loss and gradient norm; the same answer on every rank."""

    def __init__(self, rule: SpikeRule | None = None) -> None:
        self.rule = rule or SpikeRule()
        self.stats = {metric: LogEma() for metric in METRICS}
        self.grace = LrGrace(self.rule.grace)

    def observe(self, values: dict[str, float], lr: float | None = None) -> list[Spike]:
        """Judge then learn one step's values (``{"loss": ..., "grad_norm": ...}``).

        ``lr``: the learning rate the host sees (None: unknown). Non-finite or non-positive
        values are neither judged nor learned (the non-finite guard owns those steps)."""
        judging = self.grace.judging(lr)
        found: list[Spike] = []
        for metric in METRICS:
            spike = self.observe_one(metric, values.get(metric), judging)
            if spike is not None:
                found.append(spike)
        return found

    def observe_one(self, metric: str, value: float | None, judging: bool) -> Spike | None:
        """Judge then learn one metric's value (``observe`` per metric; the per-step path:
        one call per metric, sigma computed once)."""
        if value is None or not 0.0 < value < math.inf:  # NaN fails both comparisons
            return None
        ema = self.stats[metric]
        x = math.log(value)
        rule = self.rule
        spike = None
        if ema.count == 0:
            ema.count, ema.mean, ema.var = 1, x, 0.0
            return None
        sigma = max(math.sqrt(ema.var), SIGMA_FLOOR)
        r = x - ema.mean
        if ema.count >= rule.warmup:
            if judging and r / sigma > rule.z_threshold and r > math.log(rule.ratio):
                base = math.exp(ema.mean)
                spike = Spike(metric, value, base, r / sigma, rule.z_threshold, value / base)
            bound = CLAMP_SIGMAS * sigma
            r = min(max(r, -bound), bound)
        alpha = max(1.0 - rule.beta, 1.0 / (ema.count + 1))  # LogEma.update, inlined
        ema.mean += alpha * r
        ema.var = (1.0 - alpha) * (ema.var + alpha * r * r)
        ema.count += 1
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {
            "stats": {m: [e.count, e.mean, e.var] for m, e in self.stats.items()},
            "lr": self.grace.lr,
            "grace_left": self.grace.left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for metric, (count, mean, var) in state["stats"].items():
            self.stats[metric] = LogEma(int(count), float(mean), float(var))
        self.grace.lr = state["lr"]
        self.grace.left = int(state["grace_left"])


class DeviceSpikeDetector:
    """The same rule on the device (sync-free ``guard.step()``): float64 tensors, no host read.

    ``stats`` is ``[2, 3]``: per metric (loss, grad_norm) the count, mean and variance.
    ``grace`` is ``[last learning rate (0: none yet), grace steps left]``: the LR grace of
    ``LrGrace``, on the device too, fed the agreed learning rate (``Consensus.agreed_lr``).
    """

    def __init__(self, rule: SpikeRule, device: torch.device) -> None:
        self.rule = rule
        self.stats = torch.zeros(len(METRICS), 3, dtype=torch.float64, device=device)
        self.grace = torch.zeros(2, dtype=torch.float64, device=device)

    def observe(self, values: Tensor, lr: Tensor) -> Tensor:
        """Judge then learn ``values`` (float64 ``[loss, grad_norm]`` on the device); ``lr``:
        the agreed learning rate (a float64 0-d device tensor, 0: unknown).

        Returns float64 ``[2, 4]``: per metric ``[spike, value, baseline, score]`` (spike is
        1.0 or 0.0). Non-finite or non-positive values are neither judged nor learned."""
        rule = self.rule
        judging = self._judging(lr)
        count, mean, var = self.stats.unbind(1)
        usable = torch.isfinite(values) & (values > 0)
        x = torch.where(usable, values, torch.ones_like(values)).log()
        sigma = var.sqrt().clamp(min=SIGMA_FLOOR)
        score = (x - mean) / sigma
        ready = usable & (count >= rule.warmup)
        spike = ready & (score > rule.z_threshold) & (x - mean > math.log(rule.ratio)) & judging
        verdict = torch.stack([spike.double(), values, mean.exp(), score], dim=1)
        self._update(x, usable, count, mean, var, sigma)
        return verdict

    def _judging(self, lr: Tensor) -> Tensor:
        """``LrGrace.judging`` on the device: False while in the grace after an LR jump."""
        last, left = self.grace.unbind()
        known = lr > 0
        jump = known & (last > 0) & (lr > last * LR_JUMP)
        left = torch.where(jump, torch.full_like(left, float(self.rule.grace)), left)
        judging = left <= 0
        self.grace.copy_(
            torch.stack([torch.where(known, lr, last), torch.where(judging, left, left - 1)])
        )
        return judging

    def _update(
        self, x: Tensor, usable: Tensor, count: Tensor, mean: Tensor, var: Tensor, sigma: Tensor
    ) -> None:
        rule = self.rule
        first = count == 0
        alpha = torch.maximum(torch.full_like(count, 1.0 - rule.beta), 1.0 / (count + 1))
        r = x - mean
        bound = torch.where(count >= rule.warmup, CLAMP_SIGMAS * sigma, math.inf)
        r = torch.maximum(torch.minimum(r, bound), -bound)
        new_mean = torch.where(first, x, mean + alpha * r)
        new_var = torch.where(first, torch.zeros_like(var), (1 - alpha) * (var + alpha * r * r))
        new = torch.stack([count + 1, new_mean, new_var], dim=1)
        self.stats.copy_(torch.where(usable.unsqueeze(1), new, self.stats))
