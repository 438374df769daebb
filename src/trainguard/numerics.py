"""Numbers as trainguard reports them, shared by every part (step, capture, replay, report)."""

from __future__ import annotations

import math


def norm_or_inf(norm: float) -> float:
    """A gradient norm as reported: NaN (a NaN gradient) becomes Inf, so a bad norm reads one
    way in events, bundles and replays."""
    return norm if math.isfinite(norm) else math.inf
