"""Which rank made the non-finite values of a multi-rank step, and which only received them.

DDP's gradient all-reduce spreads one rank's NaN gradient to every rank: the manifest then
lists every rank in ``grad_ranks`` although one rank's own backward made it. Replay finds
the origin without ``--rank``:

- the ranks whose loss went bad (``loss_ranks``) are the origin (``method: manifest``); the
  other ranks with bad gradients received them through the all-reduce;
- when only gradients were bad, on several ranks, each saved rank's part is replayed once
  (``method: replay``): a rank whose own replay is non-finite made it (``origin``), one
  whose replay is finite only received it (``received``);
- the diagnosis (verdict, op, sample) is the first origin rank's.

With ``--rank R`` the user's rank is replayed (``method: option``); when its own replay is
finite while another rank made the NaN, the report says that R received it, not that the
step did not reproduce.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.capture.bundle import Bundle
from trainguard.errors import ReplayError
from trainguard.replay.stepper import RunResult

logger = logging.getLogger(__name__)

RankRun = Callable[[int], RunResult]
"""Replays one rank's part of the step once (its weights, batch and RNG)."""


@dataclass
class RankReplay:
    """One rank's own replay of the step."""

    rank: int
    reproduced: bool
    losses: list[float]
    grad_norm: float
    nonfinite_params: list[str]
    role: str = ""
    """``origin`` (its own replay is non-finite) or ``received`` (finite)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "role": self.role,
            "reproduced": self.reproduced,
            "losses": self.losses,
            "grad_norm": self.grad_norm,
            "nonfinite_params": self.nonfinite_params[:8],
            "nonfinite_params_total": len(self.nonfinite_params),
        }


@dataclass
class RankOrigin:
    """The rank to diagnose, and the ranks that made or received the non-finite values."""

    rank: int
    method: str
    """``manifest`` (the loss ranks), ``replay`` (every rank replayed), ``option`` (--rank)."""
    origin_ranks: list[int] = field(default_factory=list)
    received_ranks: list[int] = field(default_factory=list)
    replays: list[RankReplay] = field(default_factory=list)
    bad_elsewhere: list[int] = field(default_factory=list)
    """``--rank`` replayed finite: the ranks where the step went non-finite instead."""
    received: bool = False
    """... and this rank's gradients were non-finite: it received them from those ranks."""

    @property
    def received_from(self) -> list[int]:
        return self.bad_elsewhere if self.received else []

    def to_details(self) -> dict[str, Any]:
        return {
            "origin_method": self.method,
            "origin_ranks": self.origin_ranks,
            "received_ranks": self.received_ranks,
            "rank_replays": [r.to_dict() for r in self.replays],
            "bad_elsewhere": self.bad_elsewhere,
            "received_from": self.received_from,
        }


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def replayable(bundle: Bundle) -> list[int]:
    """The saved ranks that stored their batch."""
    return [r for r in bundle.saved_ranks if bundle.meta(r).get("batch_stored", True)]


def loss_ranks(bundle: Bundle) -> list[int]:
    found = bundle.manifest.get("loss_ranks")
    if found is None:
        found = bundle.ranks if bundle.trigger == "loss" else []
    return [int(r) for r in found]


def grad_ranks(bundle: Bundle) -> list[int]:
    found = bundle.manifest.get("grad_ranks")
    if found is None:
        found = bundle.ranks if bundle.trigger == "grad" else []
    return [int(r) for r in found]


def find_origin(bundle: Bundle, rank: int | None, run_rank: RankRun) -> RankOrigin:
    """The rank to diagnose (see the module docstring); ``run_rank`` replays one rank."""
    losses, grads = loss_ranks(bundle), grad_ranks(bundle)
    if rank is not None:
        if rank not in bundle.saved_ranks:
            raise ReplayError(f"--rank {rank}: the bundle holds ranks {bundle.saved_ranks}")
        received = [r for r in grads if r not in losses] if losses else []
        return RankOrigin(rank, "option", losses, received)
    candidates = replayable(bundle) or bundle.saved_ranks
    if bundle.trigger == "spike":  # finite everywhere: the rank with the highest loss
        return RankOrigin(_highest_loss(bundle, candidates), "manifest")
    if losses:
        chosen = next((r for r in losses if r in candidates), candidates[0])
        return RankOrigin(chosen, "manifest", losses, [r for r in grads if r not in losses])
    bad = [r for r in grads if r in candidates]
    if len(bad) > 1:
        return _by_replay(bad, run_rank)
    if bundle.trigger == "input":  # loss and gradients finite: each bad rank's own batch
        inputs = [r for r in bundle.ranks if r in candidates]
        return RankOrigin(inputs[0] if inputs else candidates[0], "manifest", inputs)
    chosen = next((r for r in bundle.ranks if r in candidates), candidates[0])
    return RankOrigin(chosen, "manifest", [r for r in bundle.ranks if r == chosen])


def _highest_loss(bundle: Bundle, candidates: list[int]) -> int:
    """A spike's rank to replay: the candidate whose recorded loss was the highest."""
    losses = bundle.manifest.get("losses") or []
    known = [r for r in candidates if r < len(losses) and isinstance(losses[r], (int, float))]
    return max(known, key=lambda r: losses[r]) if known else candidates[0]


def _by_replay(ranks: list[int], run_rank: RankRun) -> RankOrigin:
    replays = [_replay(r, run_rank) for r in ranks]
    origin = [r.rank for r in replays if r.reproduced]
    for replay in replays:
        replay.role = "origin" if replay.reproduced else "received"
    received = [r.rank for r in replays if not r.reproduced]
    logger.info("trainguard: origin ranks %s, received %s", origin, received)
    return RankOrigin(origin[0] if origin else ranks[0], "replay", origin, received, replays)


def _replay(rank: int, run_rank: RankRun) -> RankReplay:
    result = run_rank(rank)
    return RankReplay(rank, result.bad, result.losses, result.grad_norm, result.bad_params)


def went_bad_elsewhere(found: RankOrigin, bundle: Bundle, run_rank: RankRun) -> list[int]:
    """``--rank R`` replayed finite: the ranks whose own step went non-finite (the
    manifest's loss ranks, else those of the other ranks with bad gradients whose own
    replay is non-finite); sets ``found.bad_elsewhere`` and ``found.received`` (R's
    gradients were non-finite: they came from there)."""
    losses, grads = loss_ranks(bundle), grad_ranks(bundle)
    if found.rank in losses:  # its own loss went bad: nothing came from elsewhere
        return []
    found.received = found.rank in grads
    if losses:
        found.bad_elsewhere = losses
        return losses
    others = [r for r in grads if r != found.rank and r in replayable(bundle)]
    found.replays = [_replay(r, run_rank) for r in others]
    for replay in found.replays:
        replay.role = "origin" if replay.reproduced else "received"
    found.bad_elsewhere = [r.rank for r in found.replays if r.reproduced]
    found.origin_ranks = list(found.bad_elsewhere)
    if found.bad_elsewhere:
        not_origin = (r.rank for r in found.replays if not r.reproduced)
        found.received_ranks = sorted({found.rank, *not_origin})
    return found.bad_elsewhere


def origin_sentence(found: RankOrigin) -> str:
    """Appended to the diagnosis of the origin rank: who made it, who received it."""
    if found.method == "replay" and found.origin_ranks:
        own = "their own" if len(found.origin_ranks) > 1 else "its own"
        text = (
            f"The non-finite values arose on {_ranks(found.origin_ranks)}: {own} forward and "
            "backward reproduce them"
        )
        if found.received_ranks:
            finite = (
                "their own replays are finite"
                if len(found.received_ranks) > 1
                else "its own replay is finite"
            )
            text += (
                f"; {_ranks(found.received_ranks)} only received them through the gradient "
                f"all-reduce ({finite})"
            )
        return text + "."
    if found.method == "manifest" and found.received_ranks and found.origin_ranks:
        return (
            f"The loss went non-finite on {_ranks(found.origin_ranks)}; "
            f"{_ranks(found.received_ranks)} only received non-finite gradients through the "
            "gradient all-reduce."
        )
    return ""


def elsewhere_summary(found: RankOrigin, loss: float | None) -> str:
    """The summary of a ``--rank`` whose own replay is finite while the step went bad on
    another rank: it received the non-finite gradients from there, or it was fine."""
    source = _ranks(found.bad_elsewhere)
    value = f" (loss {loss:.6g}, finite gradients)" if loss is not None else ""
    how = "whose own replay reproduces them" if found.replays else "where the loss went non-finite"
    again = f"Replay without --rank (or with --rank {found.bad_elsewhere[0]}) to diagnose it."
    if not found.received:
        return (
            f"Rank {found.rank}'s step was finite when it ran and is finite when replayed"
            f"{value}: the step went non-finite on {source}, not here. {again}"
        )
    return (
        f"Rank {found.rank}'s own step is finite when replayed{value}: it received the "
        f"non-finite gradients through the gradient all-reduce; they arose on {source}, {how}. "
        f"{again}"
    )


def none_reproduces(found: RankOrigin) -> str:
    """Appended when every replayed rank is finite."""
    return (
        f" None of {_ranks(found.received_ranks)} reproduces it in its own forward and "
        "backward: the non-finite gradients arose outside them (a gradient hook, the "
        "all-reduce, or a transient fault on one of the ranks' devices)."
    )
