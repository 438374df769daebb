"""The spike statistics of a script's own resume, learned again from the run's metrics log.

``trainguard run`` attaches anew in a restarted process, and the guard's state is not in the
script's checkpoint: the spike rule's statistics began anew at every restart, so for its
first ``spikes.warmup`` steps (100) no spike was judged, and a fault that came with the
resume (a corrupted data shard, a checkpoint saved from a bad step) went unseen. Yet
the values the rule learns from are agreed and logged: rank 0's metrics log holds, for each
step, every rank's loss, the global gradient norm, the learning rates and the decision.

So at a resume to step ``N`` (``resumed.go_on``: the ranks' optimizers agree on ``N``
updates), rank 0 runs the log's steps before ``N`` through the rule, in step order, as the
guard judged them (the steps decided ``ok`` or ``spike``; a step run again after an earlier
restart once, by its last line: the run the checkpoint continues), and broadcasts the
statistics; every rank loads the same numbers (``SpikeWatch.load_state_dict``). The log holds
every step of a loop slower than 100 steps a second for its first 10,000 steps; a thinned
log (a faster loop, a longer run: ``step/metrics_log.py``) gives the rule fewer values, an
estimate of the same statistics. The learning rate read is the largest of the line's
groups', as each rank puts it in its row: a run whose ranks' rates differed learns the rates
of rank 0. A restarted command whose learning rate is over 1.1x the log's last starts the
rule's LR grace period, as any such jump does (``spikes.LrGrace``).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from trainguard.distributed.objects import broadcast_object
from trainguard.step.consensus import buffer_device
from trainguard.step.guard import Guard
from trainguard.step.metrics_log import metrics_path
from trainguard.step.spikes import SpikeDetector
from trainguard.step.spikewatch import SpikeWatch

logger = logging.getLogger(__name__)

JUDGED = ("ok", "spike")
"""The decisions of steps the spike rule judged (and learned from)."""

HISTORY = "spike_history"
"""The event of a resume whose spike statistics were learned from the metrics log."""


def _lines_before(path: Path, step: int) -> list[dict[str, Any]]:
    """The log's last line of each step before ``step``, in step order."""
    last: dict[int, dict[str, Any]] = {}
    with path.open(encoding="utf-8") as fh:
        for text in fh:
            try:
                line = json.loads(text)
            except ValueError:  # a line cut by a kill
                continue
            found = line.get("step") if isinstance(line, dict) else None
            if isinstance(found, int) and 0 <= found < step:
                last[found] = line
    return [last[s] for s in sorted(last)]


def _number(value: Any) -> float | None:
    """A positive finite number, else None (as the rule reads it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0.0 < value < math.inf else None


def _lr(line: dict[str, Any]) -> float | None:
    """The learning rate of the step's row: the largest positive finite of the groups'."""
    values = line.get("lrs") or [line.get("lr")]
    found = [v for v in (_number(v) for v in values) if v is not None]
    return max(found) if found else None


def _loss(line: dict[str, Any]) -> float | None:
    """The mean over the ranks' losses (``Agreement.mean_loss``), None when not logged."""
    losses = line.get("losses")
    if isinstance(losses, list) and losses and all(_number(v) is not None for v in losses):
        return float(sum(losses) / len(losses))
    summary = line.get("loss_summary")  # past 64 ranks
    return _number(summary.get("mean")) if isinstance(summary, dict) else None


def replay(path: Path, step: int, watch: SpikeWatch) -> int:
    """Run the log's judged steps before ``step`` through a fresh rule of ``watch``'s and
    hand it to ``watch`` (with its spike counts) when it learned any; returns how many."""
    if not path.is_file():
        return 0
    detector = SpikeDetector(watch.rule)
    consecutive = total = learned = 0
    for line in _lines_before(path, step):
        if line.get("decision") not in JUDGED:
            continue
        judging = detector.grace.judging(_lr(line))
        found = [
            detector.observe_one("loss", _loss(line), judging),
            detector.observe_one("grad_norm", _number(line.get("grad_norm")), judging),
        ]
        spiked = any(spike is not None for spike in found)
        consecutive, total = (consecutive + 1, total + 1) if spiked else (0, total)
        learned += 1
    if learned:
        watch.detector, watch.consecutive, watch.total = detector, consecutive, total
    return learned


def resume_spikes(guard: Guard, step: int) -> None:
    """At a resume to ``step`` on every rank alike (a collective over the default group,
    as the attach's all-gather, when there are several ranks): the guard goes on from
    ``step``; rank 0 replays the run's metrics log into its spike rule, and every rank
    takes rank 0's statistics."""
    guard.load_state_dict({"step": step})
    watch, learned = guard.spikes, 0
    if watch.enabled and guard.rank == 0:
        try:
            learned = replay(metrics_path(guard.run_dir), step, watch)
        except (OSError, ValueError, TypeError, KeyError):  # never fails the resume
            logger.debug("trainguard run: the metrics log could not be replayed", exc_info=True)
    if guard.world_size > 1:
        params = (p for group in guard.optimizer.param_groups for p in group["params"])
        device = next(params, torch.zeros(())).device
        mine = (watch.state_dict(), watch.total, learned) if learned else None
        found = broadcast_object(mine, 0, None, buffer_device(None, device))
        if found is not None and guard.rank != 0:
            watch.load_state_dict(found[0])
            watch.total, learned = found[1], found[2]
    if learned:
        guard.events.write(HISTORY, step, steps=learned)
