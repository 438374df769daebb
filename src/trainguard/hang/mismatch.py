"""Do the stalled ranks wait in the same collective? Pure functions over the ranks'
``CollectiveRecord`` s.

* **Flight recorder** (every record has its group's last collectives): the first sequence id
  where the ranks differ, among the ids any rank's window holds and each rank's next one:
  ranks that never entered it (**behind** in collective count) while others did, or ranks
  whose op or input sizes there differ (**op**).
* **Stacks** (some rank has no flight recorder): ranks in no collective while others wait in
  one (**behind**), or ranks waiting in different collectives (**op**). No sequence ids.

Culprits: the ranks behind; else the ranks outside the largest group (the minority
collectives). When the largest groups tie, nobody can be singled out: every rank that
entered is a culprit. Equal records are no mismatch (None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.hang.collective_record import FLIGHT_RECORDER, STACK, Call, CollectiveRecord

BEHIND = "behind"
OP = "op"
NEVER_ENTERED = "never entered it"
NO_COLLECTIVE = "in no collective"


@dataclass(frozen=True)
class Side:
    """Ranks that agree at the mismatch: what they wait in (``entered`` False: they never
    entered it) and where they called it."""

    ranks: list[int]
    what: str
    sites: list[str]
    entered: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": self.ranks,
            "what": self.what,
            "sites": self.sites,
            "entered": self.entered,
        }


@dataclass(frozen=True)
class Mismatch:
    kind: str
    """``behind`` (some ranks never entered the collective) or ``op`` (ops or sizes differ)."""
    culprits: list[int]
    sides: list[Side]
    """The culprits' sides first."""
    seq: int | None
    """The first differing sequence id (flight recorder only)."""
    source: str

    def line(self) -> str:
        """One line for a person (``report.txt``, the verdict's reason): the culprits' sides,
        then "while" the others (on a tie: the first side, then the rest)."""
        at = f" at sequence id {self.seq}" if self.seq is not None else ""
        blamed = [s for s in self.sides if set(s.ranks) <= set(self.culprits)]
        others = [s for s in self.sides if s not in blamed]
        if not others:
            blamed, others = blamed[:1], blamed[1:]
        head = ", ".join(map(_say, blamed))
        tail = ", ".join(map(_say, others))
        return f"collective mismatch{at}: {head} while {tail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "culprits": self.culprits,
            "seq": self.seq,
            "source": self.source,
            "sides": [s.to_dict() for s in self.sides],
            "line": self.line(),
        }


def find_mismatch(records: Mapping[int, CollectiveRecord]) -> Mismatch | None:
    """The ranks' first disagreement, or None (module docstring)."""
    if len(records) < 2:
        return None
    if all(r.source == FLIGHT_RECORDER and r.last for r in records.values()):
        return by_sequence(records)
    return by_stack(records)


# -- flight recorder --------------------------------------------------------------------------


def by_sequence(records: Mapping[int, CollectiveRecord]) -> Mismatch | None:
    for seq in candidate_seqs(list(records.values())):
        entered: dict[int, Call] = {}
        missing: list[int] = []
        for rank, record in sorted(records.items()):
            top = record.top
            if top is None or seq > top:
                missing.append(rank)
                continue
            call = call_at(record, seq)
            if call is not None:  # None: before this rank's window; it entered, but what?
                entered[rank] = call
        whats = {rank: _what_at(records[rank], call) for rank, call in entered.items()}
        if missing and len(missing) < len(records):
            return _behind(records, missing, whats, seq, FLIGHT_RECORDER)
        signatures = {rank: call.signature() for rank, call in entered.items()}
        if len(set(signatures.values())) > 1:
            whats = _with_sizes(entered, whats)
            return _op_mismatch(records, signatures, whats, seq, FLIGHT_RECORDER)
    return None


def candidate_seqs(records: Sequence[CollectiveRecord]) -> list[int]:
    """Sequence ids where ranks can differ: every id a window holds, and each rank's next."""
    seqs: set[int] = set()
    for record in records:
        seqs.update(call.seq for call in record.last)
        if record.top is not None:
            seqs.add(record.top + 1)
    return sorted(seqs)


def call_at(record: CollectiveRecord, seq: int) -> Call | None:
    return next((call for call in record.last if call.seq == seq), None)


def _what_at(record: CollectiveRecord, call: Call) -> str:
    """The record's label for the call it waits in (``DDP's gradient all_reduce``), the op
    for an earlier one."""
    return record.what if record.seq == call.seq else call.op


def _with_sizes(entered: Mapping[int, Call], whats: Mapping[int, str]) -> dict[int, str]:
    """Sizes added where two different signatures share an op (only the sizes differ)."""
    ops = [op for op, _ in {call.signature() for call in entered.values()}]
    return {
        rank: f"{whats[rank]} {call.sizes}" if ops.count(call.op) > 1 else whats[rank]
        for rank, call in entered.items()
    }


# -- stacks -----------------------------------------------------------------------------------


def by_stack(records: Mapping[int, CollectiveRecord]) -> Mismatch | None:
    whats = {rank: r.what for rank, r in records.items() if r.op is not None}
    idle = sorted(rank for rank, r in records.items() if r.op is None)
    if whats and idle:
        return _behind(records, idle, whats, None, STACK)
    if len(set(whats.values())) > 1:
        return _op_mismatch(records, whats, whats, None, STACK)
    return None


# -- the verdict ------------------------------------------------------------------------------


def _group(keys: Mapping[int, Any]) -> list[list[int]]:
    """Ranks with equal keys, each group sorted, smallest groups first."""
    groups: dict[Any, list[int]] = {}
    for rank in sorted(keys):
        groups.setdefault(keys[rank], []).append(rank)
    return sorted(groups.values(), key=lambda ranks: (len(ranks), ranks))


def _behind(
    records: Mapping[int, CollectiveRecord],
    missing: list[int],
    whats: Mapping[int, str],
    seq: int | None,
    source: str,
) -> Mismatch:
    what = NEVER_ENTERED if seq is not None else NO_COLLECTIVE
    sides = [Side(missing, what, _sites(records, missing), entered=False)]
    for ranks in reversed(_group(whats)):
        sides.append(Side(ranks, whats[ranks[0]], _sites(records, ranks)))
    return Mismatch(BEHIND, list(missing), sides, seq, source)


def _op_mismatch(
    records: Mapping[int, CollectiveRecord],
    keys: Mapping[int, Any],
    whats: Mapping[int, str],
    seq: int | None,
    source: str,
) -> Mismatch:
    groups = _group(keys)
    largest = len(groups[-1])
    tie = len(groups) > 1 and len(groups[-2]) == largest
    blamed = groups if tie else groups[:-1]
    culprits = sorted(rank for ranks in blamed for rank in ranks)
    sides = [Side(ranks, whats[ranks[0]], _sites(records, ranks)) for ranks in groups]
    return Mismatch(OP, culprits, sides, seq, source)


def _sites(records: Mapping[int, CollectiveRecord], ranks: list[int]) -> list[str]:
    sites: list[str] = []
    for rank in ranks:
        site = records[rank].site
        if site and site not in sites:
            sites.append(site)
    return sites


def _say(side: Side) -> str:
    who = rank_list(side.ranks)
    shown = ", ".join(side.sites[:2]) + (", ..." if len(side.sites) > 2 else "")
    one = len(side.ranks) == 1
    if not side.entered:
        what = side.what if side.what != NO_COLLECTIVE else f"{'is' if one else 'are'} {side.what}"
        return f"{who} {what}" + (f" (at {shown})" if shown else "")
    return f"{who} {'waits' if one else 'wait'} in {side.what}" + (f" ({shown})" if shown else "")


def rank_list(ranks: Sequence[int]) -> str:
    """``rank 0``, ``ranks 1-3``, ``ranks 0, 2, 5``."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
