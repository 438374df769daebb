"""Resume from the freshest state every rank can be given: states at a failure first.

At a restart with ``resume=True`` each rank says what it can offer: the states at a failure
its node's folder holds (any rank's), and its own step-start records (``mirror.py``). One
``all_gather_object`` gives every rank the same offers, from which every rank picks the same
step: the newest, newer than the newest good checkpoint, at which

- some rank can read a state (a survivor's), and every state written at that step holds the
  same weights (their digests; states that differ are refused: something was wrong);
- every rank has its own part: its own state, or (a data-parallel job: the weights and
  optimizer are replicated) its step-start record of that step, without a loader state of
  its own; a job whose state is not replicated needs every rank's own state.

The lowest rank that can read a state at the step (its own first) loads it, checks its size
and SHA-256 and broadcasts the replicated part over the new process group: a rank restarted
on another node gets it too, no shared folder needed. Each rank then takes its RNG states and
data position from its own state or record, its buffers from its own state (else the
survivor's). A state that fails its checksum or cannot be loaded on some rank is refused
(``failure_state_refused``) and the next freshest is tried; none left: the checkpoints on disk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.events import EventLog
from trainguard.recovery.agree import true_on_every_rank
from trainguard.recovery.checkpoint import restore_own_buffers
from trainguard.recovery.failure import store
from trainguard.recovery.failure.mirror import MirrorRecord, mirror_path, read_mirror
from trainguard.recovery.failure.shards import globalize
from trainguard.recovery.snapshot import TrainingObjects

logger = logging.getLogger(__name__)


@dataclass
class Fresh:
    """The state a resume took."""

    step: int
    extras: dict[str, Any]
    """``guard``, ``recovery``, ``data``, ``rng``: as a checkpoint's extras."""
    source: int
    """The rank whose state every rank took the replicated part from."""
    saved_by: list[int]
    """The ranks whose state at a failure was there at ``step``."""
    from_records: list[int]
    """The ranks that took their own part from their step-start record."""


@dataclass
class _Candidate:
    step: int
    source: int
    source_reads: int
    """The writer whose state the source reads (its own when it wrote one)."""
    writers: list[int]
    own: list[int]
    """The ranks that read their own state."""
    from_records: list[int]


def _offer(folder: Path | None, rank: int) -> dict[str, Any]:
    if folder is None:  # this rank's folder is not usable: it offers nothing
        return {"rank": rank, "files": [], "records": {}}
    files = [
        (s.step, s.rank, s.meta.get("digest"), s.meta.get("world_size"), s.writer)
        for s in store.states(folder)
    ]
    records = {r.step: r.stateful_loader for r in read_mirror(mirror_path(folder, rank))}
    return {"rank": rank, "files": files, "records": records}


def candidates(
    offers: list[dict[str, Any]], world: int, replicated: bool, newer_than: int
) -> tuple[list[_Candidate], list[tuple[int, str]]]:
    """The steps a resume may take, newest first, and the steps refused with the reason.
    The same on every rank (computed from the gathered offers only)."""
    by_step: dict[int, dict[int, str | None]] = {}
    seen_by: dict[int, dict[int, set[int]]] = {}  # step -> rank -> writers it can read
    for offer in offers:
        for step, writer, digest, world_size, by in offer["files"]:
            if world_size != world or by != writer:
                continue  # another's snapshot shard a peer holds: sharded state only
            by_step.setdefault(step, {})[writer] = digest
            seen_by.setdefault(step, {}).setdefault(offer["rank"], set()).add(writer)
    found, refused = [], []
    for step in sorted(by_step, reverse=True):
        if step <= newer_than:
            break
        writers = by_step[step]
        if len(set(writers.values())) > 1:
            refused.append((step, f"the states written at step {step} hold different weights"))
            continue
        readers = seen_by[step]
        own = [r for r in range(world) if r in readers.get(r, set())]
        records = [
            o["rank"] for o in offers if o["rank"] not in own and o["records"].get(step) is False
        ]
        missing = sorted(set(range(world)) - set(own) - (set(records) if replicated else set()))
        if missing:
            refused.append((step, f"rank(s) {missing} have neither a state nor a record of it"))
            continue
        source = min(readers)
        reads = source if source in readers[source] else min(readers[source])
        found.append(_Candidate(step, source, reads, sorted(writers), own, sorted(records)))
    return found, refused


def sharded_candidates(
    offers: list[dict[str, Any]], world: int, newer_than: int
) -> tuple[list[tuple[int, list[int]]], list[tuple[int, str]]]:
    """Sharded state: the steps at which every rank's shard can be read by some rank, newest
    first, each with the rank that reads each shard (its owner when it can)."""
    readers: dict[int, dict[int, set[int]]] = {}  # step -> owner -> ranks that can read it
    for offer in offers:
        for step, owner, _, world_size, _ in offer["files"]:
            if world_size == world:
                readers.setdefault(step, {}).setdefault(owner, set()).add(offer["rank"])
    found, refused = [], []
    for step in sorted(readers, reverse=True):
        if step <= newer_than:
            break
        by_owner = readers[step]
        missing = [q for q in range(world) if q not in by_owner]
        if missing:
            refused.append((step, f"the shards of rank(s) {missing} are not there"))
            continue
        holders = [q if q in by_owner[q] else min(by_owner[q]) for q in range(world)]
        found.append((step, holders))
    return found, refused


def fresh_resume(
    folder: Path | None,
    objects: TrainingObjects,
    events: EventLog,
    group: dist.ProcessGroup | None,
    device: torch.device,
    rank: int,
    world: int,
    replicated: bool,
    newer_than: int,
) -> Fresh | None:
    """Collective. The state loaded into ``objects`` (see the module docstring), or None."""
    offers = _gather(_offer(folder, rank), group, world)
    if folder is None:
        folder = Path("/nonexistent")  # offered nothing: never chosen to read
    if not replicated:
        place = _Place(folder, group, device, rank, world)
        return _sharded_resume(place, offers, objects, events, newer_than)
    found, refused = candidates(offers, world, replicated, newer_than)
    for step, reason in refused:
        events.write("failure_state_refused", step, reason=reason)
    for candidate in found:
        extras, error = _load(folder, candidate, objects, group, device, rank, world)
        if true_on_every_rank(not error, group, device):
            return Fresh(
                candidate.step,
                extras,
                candidate.source,
                candidate.writers,
                candidate.from_records,
            )
        events.write(
            "failure_state_refused", candidate.step, reason=error or "refused on another rank"
        )
    return None


def _gather(offer: dict[str, Any], group: dist.ProcessGroup | None, world: int) -> list[Any]:
    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return [offer]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, offer, group=group)
    return out


def _read(folder: Path, step: int, owner: int) -> dict[str, Any]:
    """Rank ``owner``'s state at ``step`` (its own copy first, else a peer's), its size and
    checksum checked first (ValueError when they differ)."""
    match = [s for s in store.states(folder) if s.step == step and s.rank == owner]
    match.sort(key=lambda s: s.writer != owner)
    if not match or not match[0].intact():
        raise ValueError(f"the state of rank {owner} at step {step} fails its checksum")
    state: dict[str, Any] = torch.load(match[0].path, weights_only=False, map_location="cpu")
    return state


def _load(
    folder: Path,
    candidate: _Candidate,
    objects: TrainingObjects,
    group: dist.ProcessGroup | None,
    device: torch.device,
    rank: int,
    world: int,
) -> tuple[dict[str, Any], str]:
    """This rank's part of the collective load: (extras, "") or ({}, why not)."""
    step, error = candidate.step, ""
    own: dict[str, Any] | None = None
    shared: dict[str, Any] | None = None
    try:
        if rank in candidate.own:
            own = _read(folder, step, rank)
        if rank == candidate.source:
            shared = own if own is not None else _read(folder, step, candidate.source_reads)
    except Exception as exc:  # damaged: refused on every rank (the agreement after)
        error = f"{type(exc).__name__}: {exc}"[:300]
    if world > 1 and candidate.from_records:
        shared = _broadcast(shared if not error else None, candidate.source, group, device)
        if shared is None and not error:
            error = f"rank {candidate.source} could not read its state"
    elif shared is None:
        shared = own
    if error or shared is None:
        return {}, error or "no state"
    try:  # a rank that raises here would leave the others in the agreement: refused instead
        mine = own if own is not None else _from_record(folder, step, rank, shared)
        if mine is None:
            return {}, f"rank {rank}'s record of step {step} is gone"
        objects.load(shared["state"] if own is None else own["state"])
        restore_own_buffers(objects.model, mine["buffers"])
    except Exception as exc:
        return {}, f"{type(exc).__name__}: {exc}"[:300]
    extras = {k: mine[k] for k in ("rng", "rng_at", "data")}
    extras |= {k: shared[k] for k in ("guard", "recovery")}
    return extras, ""


def _broadcast(
    state: dict[str, Any] | None,
    source: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> dict[str, Any] | None:
    box: list[Any] = [state]
    src = dist.get_global_rank(group, source) if group is not None else source
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    value: dict[str, Any] | None = box[0]
    return value


def _from_record(
    folder: Path, step: int, rank: int, shared: dict[str, Any]
) -> dict[str, Any] | None:
    """This rank's own part from its step-start record; its buffers are the survivor's."""
    record: MirrorRecord | None = next(
        (r for r in read_mirror(mirror_path(folder, rank)) if r.step == step), None
    )
    if record is None:
        return None
    return {
        "rng": record.rng_state(),
        "rng_at": record.at,
        "data": {"epoch": record.epoch, "position": record.position, "loader": None},
        "buffers": shared["buffers"],
    }


@dataclass
class _Place:
    """Where this rank is: its folder, group, device, rank and world size."""

    folder: Path
    group: dist.ProcessGroup | None
    device: torch.device
    rank: int
    world: int


def _sharded_resume(
    place: _Place,
    offers: list[dict[str, Any]],
    objects: TrainingObjects,
    events: EventLog,
    newer_than: int,
) -> Fresh | None:
    """Sharded state: the newest step every rank's shard is there for; each shard is sent to
    its owner by the rank that reads it."""
    found, refused = sharded_candidates(offers, place.world, newer_than)
    for step, reason in refused:
        events.write("failure_state_refused", step, reason=reason)
    for step, holders in found:
        mine, error = _own_shard(place, step, holders)
        if mine is not None and not error:
            try:
                objects.load(globalize(mine["state"], objects))
                restore_own_buffers(objects.model, mine.get("buffers") or {})
            except Exception as exc:  # refused on every rank (the agreement after)
                error = f"{type(exc).__name__}: {exc}"[:300]
        if true_on_every_rank(not error, place.group, place.device) and mine is not None:
            extras = {k: mine[k] for k in ("rng", "rng_at", "data", "guard", "recovery")}
            return Fresh(step, extras, holders[place.rank], sorted(set(holders)), [])
        why = error or "refused on another rank"
        events.write("failure_state_refused", step, reason=why)
    return None


def _own_shard(place: _Place, step: int, holders: list[int]) -> tuple[dict[str, Any] | None, str]:
    """Collective: this rank's shard at ``step``, read here or sent by the rank holding it."""
    mine: dict[str, Any] | None = None
    error = ""
    for owner, holder in enumerate(holders):
        payload: dict[str, Any] | None = None
        if place.rank == holder:
            try:
                payload = _read(place.folder, step, owner)
            except Exception as exc:  # damaged: the owner is told by a None
                error = error or f"{type(exc).__name__}: {exc}"[:300]
        if holder != owner and place.world > 1:
            payload = _broadcast(payload, holder, place.group, place.device)
        if place.rank == owner:
            mine = payload
            if payload is None:
                error = error or f"rank {holder} could not read rank {owner}'s shard"
    return mine, error
