"""States at a failure as the process ends: written by SIGTERM while the main thread is
blocked in C, not by a forked child, released at exit by a guard never closed, and the exit
status of a rank the watchdog ends while the state is written. (The record, the folder and
the choice: ``test_failure_state.py``.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.events import read_events
from trainguard.recovery.failure import store

_BLOCKED_IN_C = """
import ctypes, sys, torch
from torch import nn
import trainguard as tg
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
guard = tg.Guard(model, opt, run_dir=sys.argv[1], resume=True, hang_timeout=0)
data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(10)]
mutex = ctypes.create_string_buffer(64)  # a default pthread mutex: zeroes
libc = ctypes.CDLL(None)
with guard:
    for x, y in guard.watch(data):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if guard.state.step == 3:  # blocked in C for good, as in a collective that never ends
            print("blocked", flush=True)
            libc.pthread_mutex_lock(mutex)
            libc.pthread_mutex_lock(mutex)
        if guard.check(loss):
            opt.step()
        opt.zero_grad()
"""


@pytest.mark.timeout(60)
def test_sigterm_writes_the_state_while_the_main_thread_is_blocked_in_c(tmp_path: Path) -> None:
    """torchrun's agent SIGTERMs the survivors while they wait inside a collective, where no
    Python handler runs: the state is written from a thread, then the rank ends as SIGTERM
    ends it."""
    import signal
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED_IN_C, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "blocked"
        time.sleep(0.3)
        child.send_signal(signal.SIGTERM)
        assert child.wait(30) == -signal.SIGTERM
    finally:
        child.kill()
    saved = [e for e in read_events(tmp_path) if e["kind"] == "failure_state"]
    assert [(e["step"], e["saved"], e["trigger"]) for e in saved] == [(3, True, "SIGTERM")]
    (state,) = store.states(store.job_folder(tmp_path, None))
    assert state.step == 3 and state.intact()
    store.remove_states(state.path.parent)
    store.remove_rank(state.path.parent, 0)


def test_a_forked_child_neither_keeps_the_handler_nor_wakes_the_parent(tmp_path: Path) -> None:
    """A DataLoader worker is forked from the rank and may be SIGTERMed by its loader: its
    SIGTERM must not write a state, nor reach the parent's thread through the pipe."""
    import signal

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, run_dir=tmp_path, resume=True, hang_timeout=0)
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the parent's is installed
    pid = os.fork()
    if pid == 0:  # the child: back to what was before
        ok = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.set_wakeup_fd(-1) == -1
        os._exit(0 if ok else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    os.kill(pid, signal.SIGTERM)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == -signal.SIGTERM
    time.sleep(0.5)  # the parent's thread would have woken by now
    assert not [e for e in read_events(tmp_path) if e["kind"] == "failure_state"]
    guard.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # closed: as before


def test_a_guard_whose_build_fails_leaves_no_handler(tmp_path: Path) -> None:
    import signal

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tg.ConfigError):  # refused after recovery was built
        tg.Guard(model, opt, run_dir=tmp_path, resume=True, hang_timeout=0, rerun=42)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert not store.job_folder(tmp_path, None).exists()  # the folder it made, empty: gone


_NEVER_CLOSED = """
import sys, torch
from torch import nn
import trainguard as tg
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
guard = tg.Guard(model, opt, run_dir=sys.argv[1], resume=True, hang_timeout=0)
for x in guard.watch([torch.randn(2, 4) for _ in range(3)]):
    loss = model(x).pow(2).mean()
    if guard.state.step == 2:
        print(len(list(guard.recovery.failure.folder.glob("mirror-rank-*.bin"))), flush=True)
        if sys.argv[2] == "raise":
            raise RuntimeError("the script's own error mid-step, the guard never closed")
    loss.backward()
    if guard.check(loss):
        opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("ending", ["end", "raise"])
def test_a_guard_never_closed_is_released_at_exit(tmp_path: Path, ending: str) -> None:
    """A script that ends without close() (or an exception that escapes a loop without
    ``finally``): released at the interpreter's exit as ``close()`` would. Ended for good:
    its step-start record removed; ended by an exception: the state at the failure kept."""
    folder = store.job_folder(tmp_path, None)
    # a [raise] run keeps its state in /dev/shm by design: the test removes it, and any left
    # at this path before (it would be resumed from), so that no run of the suite leaves one
    shutil.rmtree(folder, ignore_errors=True)
    try:
        _never_closed(tmp_path, ending, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _never_closed(tmp_path: Path, ending: str, folder: Path) -> None:
    run = [sys.executable, "-c", _NEVER_CLOSED, str(tmp_path), ending]
    done = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert done.returncode == (0 if ending == "end" else 1), done.stderr[-2000:]
    assert done.stdout.split() == ["1"]  # the record was there while it ran
    closes = [e for e in read_events(tmp_path) if e["kind"] == "close"]
    assert len(closes) == 1 and closes[0]["closed"] is False
    if ending == "end":
        assert not list(folder.glob("mirror-rank-*.bin")) and not store.states(folder)
    else:
        saved = [e for e in read_events(tmp_path) if e["kind"] == "failure_state"]
        assert [(e["saved"], e["trigger"]) for e in saved] == [(True, "exception: RuntimeError")]
        assert store.states(folder)


_WATCHDOG_EXITING = """
import os, signal, sys, threading, time
from trainguard.recovery.failure.on_terminate import TerminateSave

class Writer:  # the state takes 0.3 s; the watchdog exits 0.2 s after it is written
    exiting = False
    def __init__(self):
        self.done = threading.Event()
    def save(self, trigger):
        time.sleep(0.3)
        self.done.set()

writer = Writer()
TerminateSave(writer)

def watchdog():
    writer.exiting = True
    writer.save("watchdog exit")
    time.sleep(0.2)  # the metrics flushed, the hang report written
    os._exit(92)

threading.Thread(target=watchdog, daemon=True).start()
os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, while the watchdog saves
time.sleep(30)
"""


def test_a_sigterm_while_the_watchdog_ends_the_rank_leaves_it_its_exit_status() -> None:
    """A peer failed: the watchdog writes the state, then exits 92; torchrun's SIGTERM that
    came meanwhile waits for that (it ended the rank as -15 before, hiding why)."""
    done = subprocess.run(
        [sys.executable, "-c", _WATCHDOG_EXITING], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 92, done.stderr[-2000:]
