"""Frozen peers (``hang/frozen.py``): told apart from dead ones by their process state, a
stopped one ended at once, one that is not stopped given the time to end by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.hang.frozen import end, frozen_ranks, process_state, still_frozen, write_note
from trainguard.hang.heartbeat import Heartbeat

JOB = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29411", "WORLD_SIZE": "3"}
"""The launch variables of the job the test plays (the frozen ranks' and the survivor's)."""


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """Rank 1 of the job ``JOB``."""
    env = {**os.environ, **JOB, "RANK": "1"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _beat(pid: int, state: str = "running", host: str = "here") -> Heartbeat:
    return Heartbeat(3, 12, "step", 40, False, 3.0, state=state, host=host, pid=pid)


def _state_is(pid: int, wanted: str) -> None:
    deadline = time.monotonic() + 10
    while process_state(pid) != wanted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process_state(pid) == wanted


def test_a_stopped_peer_on_this_host_is_frozen_and_ended(
    child: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    child.send_signal(signal.SIGSTOP)
    _state_is(child.pid, "T")
    beats = {
        1: _beat(child.pid),
        2: _beat(child.pid, host="elsewhere"),  # another host: nothing known
        3: _beat(child.pid, state="failed"),  # its own failure: it ends by itself
        4: None,
    }
    (found,) = frozen_ranks(beats, "here", os.getpid(), JOB)
    assert (found.rank, found.state, found.step, found.phase) == (1, "T", 12, "step")
    assert "stopped (SIGSTOP" in found.describe() and "step 12" in found.describe()
    started = time.monotonic()
    assert still_frozen([found], grace=5.0) == [found]  # a stopped process gets no grace
    assert time.monotonic() - started < 1.0
    note = tmp_path / "rank-1.txt"
    write_note(note, found, by=0)
    assert "no stack dump from rank 1: rank 1 is frozen" in note.read_text()
    assert end(found)
    child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL and process_state(child.pid) is None
    assert not end(found)  # gone: nothing to end


def test_a_peer_that_ends_by_itself_within_the_grace_is_left_alone(
    child: subprocess.Popen[bytes],
) -> None:
    (found,) = frozen_ranks({1: _beat(child.pid)}, "here", os.getpid(), JOB)
    assert found.state in ("S", "R")  # alive, not stopped (a blocked interpreter)
    ender = subprocess.Popen(
        [sys.executable, "-c", f"import os, time; time.sleep(0.3); os.kill({child.pid}, 15)"]
    )
    assert still_frozen([found], grace=8.0) == []  # it ended (its own fallback's exit)
    ender.wait(timeout=10)
    child.wait(timeout=10)
    assert child.returncode == -signal.SIGTERM  # not ours


def test_a_dead_peer_is_not_frozen() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert frozen_ranks({1: _beat(proc.pid)}, "here", os.getpid(), JOB) == []


def test_a_process_of_another_job_or_rank_is_never_ended(
    child: subprocess.Popen[bytes],
) -> None:
    """The same host name and a live pid are not enough (another machine named alike,
    another container's pid namespace): the process must be that rank of this job."""
    beat = {1: _beat(child.pid)}
    assert frozen_ranks(beat, "here", os.getpid(), {**JOB, "MASTER_PORT": "1"}) == []
    assert frozen_ranks({2: _beat(child.pid)}, "here", os.getpid(), JOB) == []  # rank 1's
    assert frozen_ranks(beat, "here", os.getpid(), {}) == []  # nothing to compare: not ours
    assert frozen_ranks(beat, "here", os.getpid(), JOB) != []
