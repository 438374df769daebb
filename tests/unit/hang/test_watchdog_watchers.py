"""Watcher ranks (``trainguard.hang.watchers``): who reads every heartbeat, what the others
read, and detection when a watcher itself dies. Ticked on a fake clock with the in-memory
store of ``test_watchdog_protocol``."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_watchdog_protocol import Clock, FakeStore, Rank, report_of, run

import trainguard as tg
from trainguard.events import read_events
from trainguard.hang.channel import StoreChannel
from trainguard.hang.heartbeat import Heartbeat
from trainguard.hang.watchers import ENV, backup_after, select_watchers, watcher_count


@pytest.fixture(autouse=True)
def _no_py_spy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_PY_SPY", "0")
    monkeypatch.delenv(ENV, raising=False)


class CountingStore(FakeStore):
    """Counts the heartbeat keys each ``multi_get`` reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[list[str]] = []

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.reads.append(keys)
        return super().multi_get(keys)


def ranks(world: int, store: FakeStore, clock: Clock, run_dir: Path) -> list[Rank]:
    return [Rank(r, world, store, clock, run_dir) for r in range(world)]


def test_watchers_are_spread_over_the_members() -> None:
    assert select_watchers([0], 2) == [0]
    assert select_watchers([0, 1], 2) == [0, 1]
    assert select_watchers(list(range(6)), 2) == [0, 3]
    assert select_watchers(list(range(4096)), 2) == [0, 2048]
    assert select_watchers(list(range(4096)), 4) == [0, 1024, 2048, 3072]
    assert select_watchers([4, 6, 8, 10, 12], 2) == [4, 8]  # a process group's members
    assert select_watchers(list(range(5)), None) == [0, 1, 2, 3, 4]


def test_the_watcher_count_comes_from_the_environment() -> None:
    assert watcher_count({}) == 2
    assert watcher_count({ENV: "all"}) is None
    assert watcher_count({ENV: " 3 "}) == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match=ENV):
            watcher_count({ENV: bad})


def test_only_watchers_read_every_heartbeat(tmp_path: Path) -> None:
    store, clock = CountingStore(), Clock()
    world = ranks(6, store, clock, tmp_path)
    store.reads.clear()
    run(clock, world, 1.0)
    sizes = sorted({len(keys) for keys in store.reads})
    assert sizes == [3, 7]  # 2 watchers' heartbeats + verdict; 6 heartbeats + verdict
    full = [keys for keys in store.reads if len(keys) == 7]
    assert len(full) == 2 * 4  # ranks 0 and 3, four ticks each
    events = [e for e in read_events(tmp_path, 5) if e["kind"] == "watchdog"]
    assert events[0]["watchers"] == [0, 3]


def test_a_dead_non_watcher_is_named_by_a_watcher(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    world = ranks(6, store, clock, tmp_path)
    run(clock, world, 1.0)
    alive = [r for r in world if r is not world[5]]
    for r in alive:  # the others go on (a hang needs everyone stuck)
        r.progress.enter("check", 3)
    run(clock, alive, 3.5)
    for r in alive:
        assert r.exits == [tg.EXIT_PEER_FAILURE]
    report = report_of(tmp_path)
    assert report["culprits"] == [5] and report["reporter"] in (0, 3)
    assert report["reporter"] == report["decided_by"]


def test_a_dead_watcher_is_named_by_the_other_watcher(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    world = ranks(6, store, clock, tmp_path)
    run(clock, world, 1.0)
    alive = [r for r in world if r is not world[3]]
    for r in alive:  # the others go on (a hang needs everyone stuck)
        r.progress.enter("check", 3)
    run(clock, alive, 3.5)
    for r in alive:
        assert r.exits == [tg.EXIT_PEER_FAILURE]
    report = report_of(tmp_path)
    assert report["culprits"] == [3] and report["decided_by"] == 0


def test_when_every_watcher_dies_the_others_name_them(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    world = ranks(6, store, clock, tmp_path)
    for r in world:
        r.progress.enter("step", 7)
    run(clock, world, 1.0)
    alive = [r for r in world if r.wd.rank not in (0, 3)]
    limit = backup_after(3.0, 0.3)  # dead_after and tick of the 3 s timeout
    run(clock, alive, limit - 0.5)
    assert all(r.exits == [] for r in alive)  # a surviving watcher would decide first
    run(clock, alive, 1.0)
    for r in alive:
        assert r.exits == [tg.EXIT_PEER_FAILURE]
    report = report_of(tmp_path)
    assert report["culprits"] == [0, 3] and report["decided_by"] in (1, 2, 4, 5)
    assert "watcher ranks" in str(report["reason"])
    views = {v["rank"]: v for v in report["ranks"]}  # type: ignore[attr-defined]
    assert all(v["registered"] and v["step"] == 7 for v in views.values())  # read for the report


def test_a_hang_behind_a_non_watcher_names_it_with_step_and_phase(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    world = ranks(6, store, clock, tmp_path)
    for r in world:
        r.progress.enter("check", 9)
    world[4].progress.enter("data", 9)
    run(clock, world, 4.0)
    for r in world:
        assert r.exits == [tg.EXIT_HANG]
    report = report_of(tmp_path)
    assert report["culprits"] == [4] and report["reporter"] in (0, 3)
    views = {v["rank"]: v for v in report["ranks"]}  # type: ignore[attr-defined]
    assert views[4]["phase"] == "data" and views[4]["step"] == 9
    hang = [e for e in read_events(tmp_path, 5) if e["kind"] == "hang"]
    assert hang[0]["culprits"] == [4]


def test_with_every_watcher_closed_the_others_still_see_a_hang(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    world = ranks(6, store, clock, tmp_path)
    for r in world:
        r.progress.enter("check", 2)
    run(clock, world, 1.0)
    world[0].wd.stop()
    world[3].wd.stop()
    alive = [r for r in world if r.wd.rank not in (0, 3)]
    world[2].progress.enter("data", 3)
    for r in alive:
        if r is not world[2]:
            r.progress.enter("check", 3)
    run(clock, alive, 4.0)
    for r in alive:
        assert r.exits == [tg.EXIT_HANG]
    assert report_of(tmp_path)["culprits"] == [2]


def test_a_rank_left_running_when_the_watchers_close_does_not_judge_itself_unseen(
    tmp_path: Path,
) -> None:
    """Every rank between loops (no hang), then the watchers close their guards while rank
    2 still works: at its first tick reading every heartbeat it must not take its own
    heartbeat, never read before, for a rank absent since the watchdog started (that made a
    finished run exit 91)."""
    store, clock = FakeStore(), Clock()
    world = ranks(3, store, clock, tmp_path)
    assert select_watchers([0, 1, 2], 2) == [0, 1]
    for r in world:
        r.progress.enter("step", 1)
    run(clock, world, 1.0)
    for r in world:
        r.progress.enter("done")
    run(clock, world, 10.0)
    world[0].wd.stop()
    world[1].wd.stop()
    run(clock, [world[2]], 3.0)
    assert [r.exits for r in world] == [[], [], []]
    assert not list(tmp_path.glob("hangs/*/report.json"))


def test_every_rank_watches_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "all")
    store, clock = CountingStore(), Clock()
    world = ranks(4, store, clock, tmp_path)
    store.reads.clear()
    run(clock, world, 0.5)
    assert {len(keys) for keys in store.reads} == {5}


def test_registration_checks_heartbeats_in_chunks() -> None:
    """A watcher of many ranks learns which heartbeats exist with one request per 64 ranks,
    and per rank only in a chunk where some are missing."""
    store = FakeStore()
    checks: list[int] = []
    check = store.check
    store.check = lambda keys: checks.append(len(keys)) or check(keys)  # type: ignore[method-assign]
    for rank in range(200):
        if rank != 70:
            store.set(f"tg/0/hb/{rank}", Heartbeat(1, 0, "step", 0, False, 3.0).encode())
    store.set("tg/0/verdict", "")
    channel = StoreChannel(store, "tg/0", 0, list(range(200)))
    beats, _ = channel.read()
    assert checks == [64, 64, *[1] * 64, 64, 8]
    assert beats[70] is None and beats[71] is not None
    checks.clear()
    channel.read()
    assert checks == [1]  # only rank 70 is still unknown
