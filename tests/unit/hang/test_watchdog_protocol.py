"""The watchdog's store protocol, driven tick by tick on a fake clock with an in-memory store:
two or three ranks' watchdogs in one process, no threads, no real exit."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import trainguard as tg
from trainguard.events import EventLog, read_events
from trainguard.hang.channel import StoreChannel
from trainguard.hang.keys import store_prefix
from trainguard.hang.progress import Progress
from trainguard.hang.timeout import TimeoutLearner, record_after
from trainguard.hang.watchdog import Watchdog


class FakeStore:
    """The part of a c10d store the watchdog uses, in memory (``down`` makes it fail)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.down = False
        self._lock = threading.Lock()

    def _up(self) -> None:
        if self.down:
            raise RuntimeError("Connection reset by peer")

    def set(self, key: str, value: str) -> None:
        self._up()
        self.data[key] = value.encode()

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        self._up()
        with self._lock:
            current = self.data.get(key)
            if (current is None and expected_value == "") or current == expected_value.encode():
                self.data[key] = desired_value.encode()
            return self.data.get(key, expected_value.encode())

    def add(self, key: str, value: int) -> int:
        self._up()
        with self._lock:
            total = int(self.data.get(key, b"0")) + value
            self.data[key] = str(total).encode()
            return total

    def check(self, keys: list[str]) -> bool:
        self._up()
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        self._up()
        return self.data[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._up()
        return [self.data[k] for k in keys]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Rank:
    """One rank's progress, events and watchdog; ``exits`` records the exit codes."""

    def __init__(
        self, rank: int, world: int, store: FakeStore, clock: Clock, run_dir: Path, **kw: object
    ) -> None:
        self.progress = Progress()
        self.events = EventLog(run_dir, rank)
        self.exits: list[int] = []
        members = list(range(world))
        timeout = kw.pop("timeout", 3.0)
        assert isinstance(timeout, float) or timeout is None
        self.wd = Watchdog(
            channel=StoreChannel(store, "tg/0", rank, members),
            main_channel=StoreChannel(store, "tg/0", rank, members),
            progress=self.progress,
            events=self.events,
            run_dir=run_dir,
            learner=TimeoutLearner(fixed=timeout),
            clock=clock,
            exit_fn=self.exits.append,
            install_hooks=False,
            faulthandler_fallback=False,
            ack_wait_s=0.0,
            store_host=kw.pop("store_host", None),  # type: ignore[arg-type]
        )
        self.wd.start(thread=False)


@pytest.fixture(autouse=True)
def _no_py_spy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_PY_SPY", "0")


def run(clock: Clock, ranks: list[Rank], seconds: float, step: float = 0.25) -> None:
    """Tick every rank every ``step`` seconds of fake time."""
    for _ in range(round(seconds / step)):
        clock.now += step
        for r in ranks:
            r.wd.tick_once()


def report_of(run_dir: Path) -> dict[str, object]:
    paths = list((run_dir / "hangs").glob("*/report.json"))
    assert len(paths) == 1
    data: dict[str, object] = json.loads(paths[0].read_text())
    return data


def test_every_rank_agrees_on_one_hang_with_the_stuck_rank_as_culprit(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    r0, r1, r2 = (Rank(r, 3, store, clock, tmp_path) for r in range(3))
    assert r0.wd.hang_id == r1.wd.hang_id == r2.wd.hang_id
    for r in (r0, r2):
        r.progress.enter("check", 4)
    r1.progress.enter("data", 4)
    run(clock, [r0, r1, r2], 2.5)
    assert r0.exits == r1.exits == r2.exits == []
    run(clock, [r0, r1, r2], 1.5)

    assert r0.exits == r1.exits == r2.exits == [tg.EXIT_HANG]
    report = report_of(tmp_path)
    assert report["kind"] == "hang" and report["culprits"] == [1]
    assert report["decided_by"] == report["reporter"]  # whoever saw it first
    ranks = {r["rank"]: r for r in report["ranks"]}  # type: ignore[attr-defined]
    assert ranks[1]["phase"] == "data" and ranks[0]["phase"] == "check"
    folder = tmp_path / "hangs" / r0.wd.hang_id
    assert {p.name for p in folder.glob("rank-*.txt")} == {"rank-0.txt", "rank-1.txt", "rank-2.txt"}
    assert "test_every_rank_agrees" in (folder / "rank-1.txt").read_text()
    assert int(store.data["tg/0/dumped"]) == 3
    for rank in range(3):
        hang = [e for e in read_events(tmp_path, rank) if e["kind"] == "hang"]
        assert len(hang) == 1 and hang[0]["culprits"] == [1] and hang[0]["exit_code"] == 91


def test_buffers_registered_before_exit_are_flushed_before_the_process_exits(
    tmp_path: Path,
) -> None:
    """The step path's buffered metrics survive ``os._exit``: flushed before the exit call,
    and a flush that fails does not stop the exit."""
    store, clock = FakeStore(), Clock()
    r0, r1 = (Rank(r, 2, store, clock, tmp_path) for r in range(2))
    order: list[str] = []

    def broken() -> None:
        raise OSError("disk full")

    r0.wd.before_exit(broken)
    r0.wd.before_exit(lambda: order.append(f"flushed, exits so far {r0.exits}"))
    r0.progress.enter("check", 4)
    r1.progress.enter("data", 4)
    run(clock, [r0, r1], 4.0)
    assert r0.exits == [tg.EXIT_HANG]
    assert order == ["flushed, exits so far []"]


def test_progress_anywhere_holds_off_a_hang(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    r0, r1 = (Rank(r, 2, store, clock, tmp_path) for r in range(2))
    r1.progress.enter("data", 2)
    for step in range(20):  # rank 0 keeps stepping although rank 1 is slow
        r0.progress.enter("check", step)
        run(clock, [r0, r1], 0.5)
    assert r0.exits == r1.exits == []


def test_silent_heartbeats_are_a_peer_failure_naming_that_rank(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    r0, r1, r2 = (Rank(r, 3, store, clock, tmp_path) for r in range(3))
    run(clock, [r0, r1, r2], 1.0)
    for r in (r0, r2):  # rank 1 is killed: it never ticks again; the others make progress
        r.progress.enter("check", 3)
    run(clock, [r0, r2], 3.5)

    assert r0.exits == r2.exits == [tg.EXIT_PEER_FAILURE]
    assert r1.exits == []
    report = report_of(tmp_path)
    assert report["kind"] == "peer_failure" and report["culprits"] == [1]
    assert "heartbeats stopped" in str(report["reason"])


def test_a_published_exception_ends_the_others_at_their_next_tick(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    r0, r1, r2 = (Rank(r, 3, store, clock, tmp_path, timeout=60.0) for r in range(3))
    run(clock, [r0, r1, r2], 1.0)
    r0.wd.publish_failure(ValueError("bad batch"))
    run(clock, [r0, r1, r2], 1.0)

    assert r0.exits == []  # the failing rank goes down with its own exception
    assert r1.exits == r2.exits == [tg.EXIT_PEER_FAILURE]
    report = report_of(tmp_path)
    assert report["culprits"] == [0] and report["reporter"] == 1
    assert report["reason"] == "rank 0 failed: ValueError: bad batch"
    assert [e["kind"] for e in read_events(tmp_path, 0)].count("failure_published") == 1
    r0.wd.stop()
    assert json.loads(store.data["tg/0/hb/0"])["state"] == "failed"


def test_a_rank_failing_after_another_keeps_its_own_error_in_the_log_and_the_events(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same bug on every rank: rank 0's verdict stands; rank 2's own exception is logged
    with its traceback and written as ``failed_too`` (the report lists it), not dropped;
    a collective's error on rank 1 is a symptom, not news."""
    store, clock = FakeStore(), Clock()
    r0, r1, r2 = (Rank(r, 3, store, clock, tmp_path, timeout=60.0) for r in range(3))
    r0.wd.publish_failure(ValueError("bad metric shape"))
    try:
        raise KeyError("labels")
    except KeyError as exc:
        with caplog.at_level("ERROR", logger="trainguard"):
            r2.wd.publish_failure(exc)
    r1.wd.publish_failure(RuntimeError("Connection closed by peer [gloo]"))
    [record] = [r for r in caplog.records if "failed too" in r.getMessage()]
    assert record.getMessage() == "trainguard: rank 2 failed too: KeyError: 'labels'"
    assert record.exc_info is not None and record.exc_info[1] is not None
    [event] = [e for e in read_events(tmp_path, 2) if e["kind"] == "failed_too"]
    assert event["reason"] == "rank 2 failed too: KeyError: 'labels'"
    assert not [e for e in read_events(tmp_path, 1) if e["kind"] == "failed_too"]
    run(clock, [r0, r1, r2], 1.0)
    assert report_of(tmp_path)["culprits"] == [0]  # the first failure is the verdict


def test_a_broken_collective_names_the_peer_that_closed_its_guard(tmp_path: Path) -> None:
    """Rank 1 ended with sys.exit (or Ctrl-C) inside its guard on another host: its
    heartbeat says closed, and rank 0's collective breaks. Rank 0 names rank 1 at once,
    instead of waiting for a dead peer that never comes and then blaming itself."""
    store, clock = FakeStore(), Clock()
    r0, r1 = (Rank(r, 2, store, clock, tmp_path, timeout=60.0) for r in range(2))
    run(clock, [r0, r1], 1.0)
    r1.wd.publish_failure(SystemExit(3))  # not published: the rank just leaves
    r1.wd.stop()
    r0.wd.publish_failure(RuntimeError("Connection closed by peer [gloo]"))
    run(clock, [r0], 0.5)
    assert r0.exits == [tg.EXIT_PEER_FAILURE]
    report = report_of(tmp_path)
    assert report["culprits"] == [1] and report["reporter"] == 0
    assert str(report["reason"]).startswith("ranks [1] left the job (their guard closed")
    assert "while rank 0 waited in a collective (RuntimeError: Connection closed" in str(
        report["reason"]
    )


def test_nonfinite_errors_are_not_published(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    r0, r1 = (Rank(r, 2, store, clock, tmp_path) for r in range(2))
    r0.wd.publish_failure(tg.NonFiniteError("nan", step=3, ranks=[0, 1]))
    r0.wd.publish_failure(tg.PeerFailureError("peer"))
    assert store.data["tg/0/verdict"] == b""
    run(clock, [r0, r1], 1.0)
    assert r0.exits == r1.exits == []


def test_a_user_phase_holds_off_a_hang_but_not_a_dead_rank(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    r0, r1, r2 = (Rank(r, 3, store, clock, tmp_path) for r in range(3))
    r0.progress.user_phases.append("eval")
    r0.progress.enter("eval")
    r1.progress.enter("step", 5)
    r2.progress.enter("step", 5)
    run(clock, [r0, r1, r2], 20.0)
    assert r0.exits == r1.exits == r2.exits == []
    run(clock, [r0, r1], 3.5)  # rank 2 dies during rank 0's evaluation
    assert r0.exits == r1.exits == [tg.EXIT_PEER_FAILURE]


def test_a_closed_rank_is_not_taken_for_dead(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    r0, r1 = (Rank(r, 2, store, clock, tmp_path) for r in range(2))
    r0.progress.enter("done", 8)
    r1.progress.enter("done", 8)
    run(clock, [r0, r1], 1.0)
    r1.wd.stop()
    run(clock, [r0], 10.0)
    assert r0.exits == []
    assert json.loads(store.data["tg/0/hb/1"])["state"] == "closed"
    kinds = [e["kind"] for e in read_events(tmp_path, 1)]
    assert kinds[0] == "watchdog" and kinds[-1] == "watchdog_stop"


def test_an_unreachable_store_blames_the_rank_that_serves_it(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    r1 = Rank(1, 2, store, clock, tmp_path, store_host=0)
    run(clock, [r1], 1.0)
    store.down = True
    run(clock, [r1], 2.5)
    assert r1.exits == []
    run(clock, [r1], 1.0)
    assert r1.exits == [tg.EXIT_PEER_FAILURE]
    report = report_of(tmp_path)
    assert report["culprits"] == [0]
    assert "store (hosted by rank 0) has not answered" in str(report["reason"])


def test_the_adaptive_timeout_is_logged_when_it_changes(tmp_path: Path) -> None:
    store, clock = FakeStore(), Clock()
    r0 = Rank(0, 1, store, clock, tmp_path, timeout=None)
    assert r0.wd.timeout == 600.0
    for step in range(1, 6):  # steps of 4 s each, 2 beats a step
        r0.progress.enter("step", step)
        run(clock, [r0], 2.0)
        r0.progress.enter("check", step)
        run(clock, [r0], 2.0)
    assert r0.wd.timeout == pytest.approx(30.0)  # 10 x 2 s is below the floor
    r0.progress.enter("data", 6)
    run(clock, [r0], 5.0)
    r0.progress.enter("step", 6)
    run(clock, [r0], 0.25)
    assert r0.wd.timeout == pytest.approx(50.0)
    logged = [
        (e["rule"], e["timeout"]) for e in read_events(tmp_path, 0) if e["kind"] == "hang_timeout"
    ]
    assert logged == [("grace", 600.0), ("learned", 30.0), ("learned", 50.0)]
    assert r0.exits == []


def test_store_prefix_separates_torchrun_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert store_prefix(0) == "trainguard/0"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert store_prefix(2) == "trainguard/job/attempt1/2"


def test_the_watchdog_arms_the_busy_probe_after_a_quarter_timeout(tmp_path: Path) -> None:
    """``on_stall`` (the guard's ``BusyProbe.arm``) runs once the loop made no progress for
    ``record_after``, and not in a user phase."""
    store, clock = FakeStore(), Clock()
    r0 = Rank(0, 1, store, clock, tmp_path, timeout=8.0)
    arms: list[float] = []
    r0.wd.on_stall.append(lambda: arms.append(clock.now))
    r0.progress.enter("step", 3)
    start = clock.now
    run(clock, [r0], 6.0, step=0.5)  # record_after(8 s) is 2 s
    assert arms and arms[0] - start >= record_after(8.0)
    arms.clear()
    r0.progress.push_phase("eval")
    run(clock, [r0], 2.0, step=0.5)
    assert arms == [] and r0.exits == []
