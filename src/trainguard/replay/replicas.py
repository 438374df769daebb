"""Replicated weights that differ across the ranks of a bundle.

Under DDP (any non-sharded data parallelism) every rank holds the same parameters; a bundle
of such a run saves each rank's copy (``rank-{r}/model.pt``). When they differ, the replicas
have drifted apart (a rank-local write, a hook, a custom op or an optimizer that edits one
rank, a bit flip, no broadcast at the start): a cause of its own, whatever the step's
replay says. Only the model's parameters are compared (``named_parameters`` keys): buffers
may differ on purpose (BatchNorm statistics under DDP without ``broadcast_buffers``).

Cheap: when every rank's ``model.pt`` has the same checksum in the manifest (the CRC-32 of
its record table, equal for equal content), nothing is loaded; otherwise each rank's
weights are loaded in turn and compared bit for bit with the distinct values seen so far.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from trainguard.capture.bundle import Bundle
from trainguard.replay.report import ReplayReport
from trainguard.replay.verdicts import ADVICE

logger = logging.getLogger(__name__)

MAX_SHOWN = 5


@dataclass
class Mismatch:
    """One parameter whose ranks disagree."""

    name: str
    groups: list[list[int]]
    """The ranks, grouped by equal values (the largest group first)."""
    disagree: list[int]
    """The ranks outside the majority (every rank when no group is a strict majority)."""
    elements: int = 0
    """Elements that differ between the first two groups."""
    numel: int = 0
    max_abs_diff: float | None = None
    nonfinite: list[int] = field(default_factory=list)
    """Ranks whose copy holds NaN or Inf."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "groups": self.groups,
            "disagree": self.disagree,
            "elements": self.elements,
            "numel": self.numel,
            "max_abs_diff": self.max_abs_diff,
            "nonfinite_ranks": self.nonfinite,
        }

    @property
    def majority(self) -> list[int] | None:
        """The ranks of the strict majority, or None when no group is one."""
        return self.groups[0] if len(self.groups[0]) > len(self.groups[1]) else None

    def text(self) -> str:
        """E.g. ``fc.weight: rank 2 differs from ranks 0, 1 and 3 (1 of 12 elements, ...)``."""
        majority = self.majority
        if majority is not None:
            verb = "differs" if len(self.disagree) == 1 else "differ"
            who = f"{_ranks(self.disagree)} {verb} from {_ranks(majority)}"
        else:
            who = f"{_ranks(self.disagree)} hold different values"
        diff = f", max |diff| {self.max_abs_diff:.3g}" if self.max_abs_diff is not None else ""
        bad = f", non-finite on {_ranks(self.nonfinite)}" if self.nonfinite else ""
        return f"{self.name}: {who} ({self.elements} of {self.numel} elements{diff}{bad})"


@dataclass
class ReplicaCheck:
    """The comparison of the saved ranks' parameters."""

    checked: bool
    ranks: list[int]
    mismatches: list[Mismatch] = field(default_factory=list)
    why: str = ""
    """Why nothing was compared (``checked`` False), or how (``checksums``, ``tensors``)."""

    @property
    def disagree(self) -> list[int]:
        return sorted({r for m in self.mismatches for r in m.disagree})

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "ranks": self.ranks,
            "identical": self.checked and not self.mismatches,
            "how": self.why,
            "mismatches": [m.to_dict() for m in self.mismatches],
            "disagreeing_ranks": self.disagree,
        }

    def sentence(self) -> str:
        """The lead of the summary when the replicas differ."""
        shown = "; ".join(m.text() for m in self.mismatches[:MAX_SHOWN])
        more = len(self.mismatches) - MAX_SHOWN
        extra = f" and {more} more parameters" if more > 0 else ""
        noun = "parameter differs" if len(self.mismatches) == 1 else "parameters differ"
        return (
            f"The replicas disagree before the step: {len(self.mismatches)} replicated {noun} "
            f"across ranks {self.ranks}: {shown}{extra}."
        )


def apply_replicas(report: ReplayReport, replicas: ReplicaCheck, rank: int) -> None:
    """Replicas that disagree are the verdict, before the numerical classes; the step's own
    diagnosis follows (or, when it replays finite, that it does)."""
    if not replicas.mismatches:
        return
    report.details["verdict_of_step"] = report.verdict
    report.verdict = "replica_mismatch"
    report.advice = ADVICE["replica_mismatch"]
    rest = report.summary
    if not report.reproduced:
        losses = report.details.get("replayed", {}).get("losses") or []
        loss = f" (loss {losses[0]:.6g})" if losses else ""
        rest = f"The step itself replays finite on rank {rank}{loss}."
    report.summary = f"{replicas.sentence()} {rest}"


def check_replicas(bundle: Bundle, names: Sequence[str]) -> ReplicaCheck:
    """Compare the parameters ``names`` across the bundle's saved ranks."""
    ranks = list(bundle.saved_ranks)
    if bundle.sharded:
        return ReplicaCheck(False, ranks, why="sharded (FSDP2): each rank holds its own shard")
    if len(ranks) < 2:
        return ReplicaCheck(False, ranks, why="one rank saved")
    if _same_checksums(bundle, ranks):
        return ReplicaCheck(True, ranks, why="checksums")
    return ReplicaCheck(True, ranks, _compare(bundle, ranks, list(names)), why="tensors")


def _same_checksums(bundle: Bundle, ranks: list[int]) -> bool:
    records = [bundle.files.get(f"rank-{r}/model.pt") for r in ranks]
    if any(not isinstance(r, dict) for r in records):
        return False
    return len({(r["crc32"], r["bytes"], r.get("over")) for r in records if r}) == 1


def _compare(bundle: Bundle, ranks: list[int], names: list[str]) -> list[Mismatch]:
    """Group the ranks by equal values, parameter by parameter (one rank loaded at a time)."""
    distinct: dict[str, list[tuple[Tensor, list[int]]]] = {}
    for rank in ranks:
        state = bundle.model_state(rank)
        for name in names:
            tensor = state.get(name)
            if tensor is None:
                continue
            seen = distinct.setdefault(name, [])
            match = next((ranks_ for value, ranks_ in seen if _equal(value, tensor)), None)
            if match is not None:
                match.append(rank)
            else:
                seen.append((tensor, [rank]))
        del state
    out = []
    for name in names:
        seen = distinct.get(name, [])
        if len(seen) > 1:
            out.append(_mismatch(name, seen))
    if out:
        logger.info("trainguard: replicas differ in %d parameters", len(out))
    return out


def _equal(a: Tensor, b: Tensor) -> bool:
    """Bit for bit, but for NaNs: a NaN equals any NaN at the same place (a blown-up run's
    NaNs carry a sign or payload that the op that made them chose, the same value to the
    optimizer; counting those as a disagreement called an LR blow-up ``replica_mismatch``)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(_bits(a), _bits(b)):
        return True
    if not a.is_floating_point():
        return False
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(both_nan.any()) and bool(((a == b) | both_nan).all())


def _bits(t: Tensor) -> Tensor:
    data = t.detach().contiguous().reshape(-1)
    return data.view(torch.uint8) if data.is_floating_point() or data.is_complex() else data


def _mismatch(name: str, seen: list[tuple[Tensor, list[int]]]) -> Mismatch:
    seen = sorted(seen, key=lambda item: (-len(item[1]), min(item[1])))
    groups = [sorted(ranks) for _, ranks in seen]
    strict = len(groups[0]) > len(groups[1])
    disagree = sorted(r for g in (groups[1:] if strict else groups) for r in g)
    if not strict:
        seen = sorted(seen, key=lambda item: min(item[1]))  # compare the lowest ranks' values
    first, second = seen[0][0], seen[1][0]
    m = Mismatch(name, groups, disagree, numel=first.numel())
    if first.shape == second.shape and (first.is_floating_point() and second.is_floating_point()):
        a, b = first.detach().double(), second.detach().double()
        differs = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
        m.elements = int(differs.sum())
        both = differs & torch.isfinite(a) & torch.isfinite(b)
        m.max_abs_diff = float((a - b).abs()[both].max()) if bool(both.any()) else None
    m.nonfinite = sorted(r for value, ranks in seen if _nonfinite(value) for r in ranks)
    return m


def _nonfinite(t: Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
