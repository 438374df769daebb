"""The exit race of issue 15, without launchers: the consensus all-reduce as the last thing a
2-rank gloo job does before the interpreter exits.

Each trial forks two children of this process (torch is imported once), which join a gloo
group, run one ``Consensus.agree`` (then ``work.retire()`` as ``Guard.close`` does, when the
consensus has it) and exit through normal interpreter shutdown. ``SWITCH`` (seconds,
``sys.setswitchinterval``) makes the main thread keep the GIL longer, which widens the window
in which gloo's worker thread still waits for the GIL when shutdown begins.

    SWITCH=100 python benchmarks/exit_race.py 30

Prints how many trials had a child that did not exit with 0 (``terminate called without an
active exception`` on stderr for the abort). Not part of CI.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from trainguard.step.consensus import DEVICE_COLUMNS, Consensus, LocalReport


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=20)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    sys.setswitchinterval(float(os.environ.get("SWITCH", "0.005")))
    consensus = Consensus()
    consensus.agree(LocalReport(torch.zeros(DEVICE_COLUMNS, dtype=torch.float64)), False)
    work = getattr(consensus, "work", None)
    if work is not None:
        work.retire()  # as Guard.close does
    raise SystemExit(0)  # unwinds to the interpreter's own shutdown


def trial() -> list[int]:
    port = _free_port()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            try:
                child(rank, port)
            except SystemExit:
                raise
            except BaseException:
                os._exit(3)
        pids.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    parent = os.getpid()
    bad = sum(1 for _ in range(runs) if trial() != [0, 0])
    if os.getpid() == parent:
        print(f"exit_race: {bad}/{runs} trials with an abnormal exit")


if __name__ == "__main__":
    main()
