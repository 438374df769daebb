"""Borderline spikes: the sync-free ``step()`` (device rule) skips exactly what ``check()``
(host rule) skips.

The rule (step/spikes.py), per metric on ``x = log(value)``: running mean ``m`` and variance
``v`` with weight ``a_n = max(1 - beta, 1 / n)``, residuals clamped to 3 sigma once
``warmup`` values are seen; a spike is ``z = (x - m) / max(sqrt(v), 0.01) > spike_z`` and
``x - m > log(spike_ratio)``, judged from the ``warmup``-th value on. The loss sequence below
is built from an independent reference of that rule so that chosen steps sit a hair above
or below the binding condition (the z-score in one case, the ratio floor in the other);
the first judged step is one of them. The gradient norm is held constant, so only the loss
can spike. Both paths must skip the same steps and end on bit-identical weights and moments.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import trainguard as tg

WARMUP = 20
BETA = 0.98
RATIO = 2.0
CLAMP = 3.0
SIGMA_FLOOR = 0.01
NOISE = 0.2
"""Log-space noise of the ordinary steps: sigma ~0.2."""
EPS = 1e-7
"""How far (relative) a borderline step sits from its threshold; float64 noise is ~1e-16."""

ABOVE, BELOW = "above", "below"
PLAN = {WARMUP: ABOVE, WARMUP + 1: BELOW, WARMUP + 4: BELOW, WARMUP + 5: ABOVE}
"""Special steps; the first judged step (``WARMUP``) is just above the threshold."""
STEPS = WARMUP + 8
EXPECTED_SKIPS = [s for s, side in sorted(PLAN.items()) if side == ABOVE]


@dataclass
class Reference:
    """The spike rule's running statistics for one metric, written from its docstring."""

    count: int = 0
    mean: float = 0.0
    var: float = 0.0

    @property
    def sigma(self) -> float:
        return max(math.sqrt(self.var), SIGMA_FLOOR)

    def update(self, x: float) -> None:
        if self.count == 0:
            self.count, self.mean = 1, x
            return
        alpha = max(1.0 - BETA, 1.0 / (self.count + 1))
        r = x - self.mean
        if self.count >= WARMUP:
            r = min(max(r, -CLAMP * self.sigma), CLAMP * self.sigma)
        self.mean += alpha * r
        self.var = (1.0 - alpha) * (self.var + alpha * r * r)
        self.count += 1


def borderline_losses(binding: str, z_threshold: float) -> list[float]:
    """The loss sequence: noise around 2.0, and the ``PLAN`` steps placed a relative ``EPS``
    above or below the condition that binds (``"z"``: the z-score; ``"ratio"``: the floor),
    the other condition holding with a wide margin."""
    rng = random.Random(5)
    ref = Reference()
    losses = []
    for step in range(STEPS):
        side = PLAN.get(step)
        if side is None:
            x = math.log(2.0) + rng.gauss(0.0, NOISE)
        else:
            assert ref.count == step >= WARMUP
            sign = 1.0 if side == ABOVE else -1.0
            z_gap = z_threshold * ref.sigma  # x - m at z == z_threshold
            ratio_gap = math.log(RATIO)
            if binding == "z":
                assert z_gap > 1.2 * ratio_gap, "the ratio floor would bind"
                x = ref.mean + z_gap * (1.0 + sign * EPS)
            else:
                assert ratio_gap > 1.2 * z_gap, "the z-score would bind"
                x = ref.mean + ratio_gap * (1.0 + sign * EPS)
        losses.append(math.exp(x))
        ref.update(math.log(losses[-1]))
    return losses


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def _train(
    run_dir: Path, losses: list[float], z_threshold: float, sync_free: bool
) -> dict[str, Any]:
    """Train on the loss sequence: each loss has exactly the given value (float64) and the
    same gradient (ones) at every step, whatever the weights."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    config = tg.GuardConfig(
        run_dir=run_dir,
        on_spike="skip",
        capture=False,
        hang_timeout=0,
        spikes=tg.SpikeConfig(warmup=WARMUP, z=z_threshold, ratio=RATIO, beta=BETA),
    )
    guard = tg.Guard(model, opt, config=config)
    unmoved = []
    for step, value in enumerate(losses):
        before = [p.detach().clone() for p in model.parameters()]
        zero: Tensor = sum((p - p.detach()).sum() for p in model.parameters())  # type: ignore[assignment]
        loss = torch.tensor(value, dtype=torch.float64) + zero.double()
        assert loss.item() == value
        loss.backward()
        if sync_free:
            outcome = guard.step(loss)
            assert repr(outcome) == "StepOutcome(pending)", "step() is not sync-free"
        else:
            if guard.check(loss):
                opt.step()
            opt.zero_grad(set_to_none=True)
        after = list(model.parameters())
        if all(torch.equal(b, a) for b, a in zip(before, after, strict=True)):
            unmoved.append(step)
    guard.close()
    return {
        "unmoved": unmoved,
        "skips": [(e["step"], e.get("reason")) for e in _events(run_dir, "skip")],
        "spikes": [(e["step"], e["metric"], e["score"]) for e in _events(run_dir, "spike")],
        "nonfinite": _events(run_dir, "nonfinite"),
        "params": [p.detach().clone() for p in model.parameters()],
        "moments": [{k: v.clone() for k, v in s.items()} for s in opt.state.values()],
    }


@pytest.mark.parametrize(("binding", "z_threshold"), [("z", 6.0), ("ratio", 1.5)])
def test_sync_free_step_skips_borderline_spikes_as_check_does(
    tmp_path: Path, binding: str, z_threshold: float
) -> None:
    losses = borderline_losses(binding, z_threshold)
    host = _train(tmp_path / "check", losses, z_threshold, sync_free=False)
    device = _train(tmp_path / "step", losses, z_threshold, sync_free=True)

    assert host["nonfinite"] == [] and device["nonfinite"] == []
    assert host["unmoved"] == EXPECTED_SKIPS, "check(): the borderline steps decided wrongly"
    assert [s for s, _ in host["skips"]] == EXPECTED_SKIPS
    assert {reason for _, reason in host["skips"]} == {"spike"}
    assert device["unmoved"] == host["unmoved"], "step(): skipped other steps on the device"
    assert device["skips"] == host["skips"]
    assert [(s, m) for s, m, _ in device["spikes"]] == [(s, "loss") for s in EXPECTED_SKIPS]
    assert [(s, m) for s, m, _ in host["spikes"]] == [(s, "loss") for s in EXPECTED_SKIPS]
    for (_, _, d_score), (_, _, h_score) in zip(device["spikes"], host["spikes"], strict=True):
        assert d_score == pytest.approx(h_score, rel=1e-9)
    for d, h in zip(device["params"], host["params"], strict=True):
        assert torch.equal(d, h)
    assert len(device["moments"]) == len(host["moments"]) > 0
    for d_state, h_state in zip(device["moments"], host["moments"], strict=True):
        assert d_state.keys() == h_state.keys()
        for key in d_state:
            assert torch.equal(d_state[key], h_state[key]), key
    assert float(device["moments"][0]["step"]) == STEPS - len(EXPECTED_SKIPS)
