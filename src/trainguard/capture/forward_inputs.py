"""A NaN made in the loop between the fetch and the forward, named as such on a bad step.

A replay starts from the batch ``watch()`` handed out (or ``record_batch`` got). Loops
change it before the forward: a normalization (``(x - mean) / std`` with a zero ``std``), an
augmentation, a cast, a device copy. A non-finite value made there is in no batch the guard
holds, so the input check passes, the replay of the stored batch comes out finite, and the
step would read as a transient fault. ``step.step_start.StepStart`` keeps references to the
inputs (positional and keyword) of the step's training forwards of the guarded module; on a
bad step's capture (host reads, bad steps only) ``forward_findings`` looks for non-finite
values in them and says whether the fetched batches held any. The bundle keeps the finding
(``meta.json``: ``forward_inputs``), ``trainguard report`` shows it under the capture and
the replay names it (verdict ``input_made_in_loop``, ``replay/diagnosis.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


def forward_findings(
    forward: Sequence[tuple[tuple[Any, ...], dict[str, Any]]] | None, batches: Sequence[Any]
) -> dict[str, Any] | None:
    """Where the step's forward inputs (``(args, kwargs)`` per forward) held non-finite
    values (per tensor: the forward, the path such as ``args[0]`` or ``kwargs['x']``, the
    sample positions), and whether the fetched ``batches`` held any (None: the guard was
    handed no batch, so nothing tells where the value came from); None when the forward
    inputs are unknown or all finite."""
    from trainguard.capture.batchtree import nonfinite_tensors  # torch: ``report`` reads without

    found = [
        {"forward": index, "path": name + entry["path"], "positions": entry["positions"]}
        for index, (args, kwargs) in enumerate(forward or [])
        for name, inputs in (("args", args), ("kwargs", kwargs))
        for entry in nonfinite_tensors([inputs])
    ]
    if not found:
        return None
    in_batch = bool(nonfinite_tensors(list(batches))) if batches else None
    return {"nonfinite": found, "in_fetched_batch": in_batch}


def made_in_loop(findings: dict[str, Any] | None) -> bool:
    """Whether the forward got non-finite inputs that the fetched batches did not hold
    (``findings``: ``forward_findings``'s, or a bundle meta's ``forward_inputs``)."""
    if not findings or not findings.get("nonfinite"):
        return False
    return findings.get("in_fetched_batch") is False


def describe(findings: dict[str, Any]) -> str:
    """``args[0] (samples [3])`` for each non-finite forward input, joined (``of forward 2``
    after it for a later micro-batch's forward)."""
    parts = []
    for entry in findings.get("nonfinite", []):
        rows, forward = entry["positions"], entry["forward"]
        parts.append(
            entry["path"]
            + (f" (samples {rows})" if rows else "")
            + (f" of forward {forward}" if forward else "")
        )
    return ", ".join(parts)


def warn_made_in_loop(findings: dict[str, Any] | None, step: int, rank: int) -> None:
    """The log line of a bad step whose non-finite forward input the batch did not hold."""
    if findings is None or not made_in_loop(findings):
        return
    logger.warning(
        "trainguard: step %d rank %d: the model's forward got non-finite input at %s that the "
        "batch handed out did not hold: it was made in the loop between the fetch and the "
        "forward (a replay starts from the batch as fetched)",
        step,
        rank,
        describe(findings),
    )
