"""The watchdog's keys in the job's c10d store (the default process group's store).

Under ``prefix`` (one per Guard): ``id`` (the run's hang id, first proposal wins),
``hb/<rank>`` (each rank's heartbeat, written only by that rank), ``verdict`` (empty until a
rank decides; the first decision wins through ``compare_set``) and ``ack`` (a counter the
ranks bump when they read the verdict) and ``dumped`` (bumped when a rank's stacks are
written). No new port and no new server: torchrun's store,
or the TCPStore that ``init_process_group`` created.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

from trainguard.hang.heartbeat import Heartbeat
from trainguard.hang.rules import Verdict

REGISTER_CHUNK = 64
"""Heartbeat keys checked for existence in one request."""


class KeyValueStore(Protocol):
    """The part of ``torch.distributed.Store`` the watchdog uses."""

    def set(self, key: str, value: str) -> None: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def get(self, key: str) -> bytes: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...


def own_connection(store: KeyValueStore, timeout_s: float) -> KeyValueStore:
    """A connection of this thread's own to ``store`` (``Store.clone``), with a short timeout
    so that a store that stops answering cannot block the caller for the process group's
    whole timeout."""
    clone = getattr(store, "clone", None)
    connection: KeyValueStore = clone() if clone is not None else store
    set_timeout = getattr(connection, "set_timeout", None)
    if clone is not None and set_timeout is not None:
        set_timeout(timedelta(seconds=timeout_s))
    return connection


class StoreChannel:
    """Reads and writes the watchdog's keys. Never waits for a key that may not exist."""

    def __init__(self, store: KeyValueStore, prefix: str, rank: int, members: list[int]) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.members = list(members)
        self._registered: set[int] = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def hb_key(self, rank: int) -> str:
        return self.key(f"hb/{rank}")

    def agree_id(self, candidate: str) -> str:
        """The run's hang id: the first rank's proposal."""
        return self.store.compare_set(self.key("id"), "", candidate).decode()

    def open(self) -> None:
        """Make sure the verdict key exists (empty), so reading it never waits."""
        self.store.compare_set(self.key("verdict"), "", "")

    def publish(self, beat: Heartbeat) -> None:
        self.store.set(self.hb_key(self.rank), beat.encode())

    def read(
        self, ranks: list[int] | None = None
    ) -> tuple[dict[int, Heartbeat | None], Verdict | None]:
        """The latest heartbeat of every member (or of ``ranks``; None before its first one)
        and the verdict, in one ``multi_get``: keyed by the members (or ``ranks``)."""
        wanted = self.members if ranks is None else ranks
        self._register_new(wanted)
        ranks = [r for r in wanted if r in self._registered]
        keys = [self.hb_key(r) for r in ranks] + [self.key("verdict")]
        values = self.store.multi_get(keys)
        beats: dict[int, Heartbeat | None] = dict.fromkeys(wanted)
        for rank, raw in zip(ranks, values, strict=False):
            beats[rank] = Heartbeat.decode(raw)
        return beats, Verdict.decode(values[-1])

    def read_verdict(self) -> Verdict | None:
        return Verdict.decode(self.store.get(self.key("verdict")))

    def propose(self, verdict: Verdict) -> Verdict:
        """Publish ``verdict`` unless another rank's came first; returns the one that holds."""
        held = self.store.compare_set(self.key("verdict"), "", verdict.encode())
        return Verdict.decode(held) or verdict

    def ack(self) -> int:
        return self.store.add(self.key("ack"), 1)

    def acks(self) -> int:
        return self.store.add(self.key("ack"), 0)

    def dumped(self) -> int:
        return self.store.add(self.key("dumped"), 1)

    def dumps(self) -> int:
        return self.store.add(self.key("dumped"), 0)

    def _register_new(self, ranks: list[int]) -> None:
        """Note which of ``ranks`` have a heartbeat (``multi_get`` would wait for a missing
        key): one ``check`` per ``REGISTER_CHUNK`` ranks, one per rank only in a chunk where
        some are missing (a watcher of 4,096 ranks starts with 64 requests, not 4,096)."""
        new = [r for r in ranks if r not in self._registered]
        for i in range(0, len(new), REGISTER_CHUNK):
            chunk = new[i : i + REGISTER_CHUNK]
            if self.store.check([self.hb_key(r) for r in chunk]):
                self._registered.update(chunk)
                continue
            for rank in chunk if len(chunk) > 1 else []:
                if self.store.check([self.hb_key(rank)]):
                    self._registered.add(rank)
