"""The hang watchdog's store traffic at scale: N virtual ranks against one real TCPStore.

One process serves a ``torch.distributed.TCPStore`` (its CPU time is read from
``/proc/<pid>/stat``). ``--procs`` client processes each host N/procs rank threads; every
thread opens its own TCPStore connection (as a real rank's watchdog thread does) and, every
tick, does what ``Watchdog.tick_once`` does through the real ``StoreChannel``: publish its
heartbeat (one ``set``) and read every member's heartbeat plus the verdict key (one
``multi_get`` of N+1 keys). Every rank judges its peers with the real ``PeerTracker`` and
``assess`` and proposes a verdict with ``compare_set`` as the watchdog does.

The cadence is the watchdog's own: ``tick_interval(timeout)`` and ``dead_after(timeout)``
from ``trainguard.hang.timeout`` (``--timeout 10``: tick 1.0 s, the same tick as the
default grace timeout and any learned timeout, dead_after 10 s). Two runs per N:

* ``stall``: the last rank's training-progress counter stops (its heartbeat goes on);
* ``kill``: the last rank stops heartbeating (its thread ends, as a killed process).

``detect`` = the first published verdict minus the fault time; ``all_saw`` = the last rank
to read the verdict minus the fault time. ``late`` counts ticks that began more than half a
tick after their schedule (client overload: the clients share the machine's cores with the
server).

    python benchmarks/watchdog_scale.py                       # N = 64 256 1024 4096
    python benchmarks/watchdog_scale.py --sizes 64 --timeout 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]

from trainguard.hang.channel import StoreChannel
from trainguard.hang.heartbeat import Heartbeat, PeerTracker
from trainguard.hang.rules import assess
from trainguard.hang.timeout import dead_after, tick_interval

HOST = "127.0.0.1"
FAULT_AT_S = 3.0
"""Seconds after the common start at which the fault happens."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _raise_fd_limit(wanted: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        soft = min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def _serve(port: int, ready: Any, stop: Any) -> None:
    _raise_fd_limit(16384)
    store = TCPStore(HOST, port, is_master=True, wait_for_workers=False)
    ready.set()
    stop.wait()
    del store


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Rank:
    """One virtual rank: the watchdog tick of ``Watchdog.tick_once``, instrumented."""

    def __init__(self, rank: int, n: int, cfg: dict[str, Any]) -> None:
        store = TCPStore(HOST, cfg["port"], is_master=False, timeout=timedelta(seconds=60))
        self.channel = StoreChannel(store, cfg["prefix"], rank, list(range(n)))
        self.rank, self.cfg = rank, cfg
        self.tracker = PeerTracker(list(range(n)), time.monotonic())
        self.pub: list[float] = []
        self.read: list[float] = []
        self.late = 0
        self.ticks = 0
        self.proposed_at: float | None = None
        self.saw_at: float | None = None
        self.channel.open()
        self.channel.publish(self._beat(0, 0))

    def _beat(self, seq: int, beats: int) -> Heartbeat:
        return Heartbeat(seq, beats, "forward", beats, False, self.cfg["timeout"])

    def run(self, t0: float) -> None:
        cfg, tick = self.cfg, self.cfg["tick"]
        faulty = self.rank == cfg["n"] - 1
        fault_at, end = t0 + FAULT_AT_S, t0 + cfg["run_s"]
        k = 0
        while True:
            k += 1
            scheduled = t0 + k * tick
            time.sleep(max(0.0, scheduled - time.time()))
            now = time.time()
            if now > end or (self.saw_at is not None and now > self.saw_at + 2 * tick):
                return
            if faulty and now >= fault_at and cfg["mode"] == "kill":
                return
            self.late += now - scheduled > tick / 2
            self.ticks += 1
            beats = k if not (faulty and now >= fault_at) else int(FAULT_AT_S / tick)
            self._tick(k, beats)

    def _tick(self, seq: int, beats: int) -> None:
        a = time.perf_counter()
        self.channel.publish(self._beat(seq, beats))
        b = time.perf_counter()
        heartbeats, verdict = self.channel.read()
        self.read.append(time.perf_counter() - b)
        self.pub.append(b - a)
        mono = time.monotonic()
        if verdict is not None:
            self.saw_at = self.saw_at or time.time()
            return
        for rank, beat in heartbeats.items():
            self.tracker.update(rank, beat, mono)
        timeout = self.cfg["timeout"]
        mine = assess(self.tracker.views(mono), self.rank, timeout, dead_after(timeout))
        if mine is not None:
            self.channel.propose(mine)
            self.proposed_at = time.time()


def _client(ranks: list[int], cfg: dict[str, Any], out: Any) -> None:
    _raise_fd_limit(16384)
    hosted = [_Rank(r, cfg["n"], cfg) for r in ranks]
    control = TCPStore(HOST, cfg["port"], is_master=False, timeout=timedelta(seconds=600))
    control.add("connected", len(hosted))
    t0 = float(control.get("t0").decode())
    threads = [threading.Thread(target=h.run, args=(t0,), daemon=True) for h in hosted]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(
        {
            "pub": [x for h in hosted for x in h.pub],
            "read": [x for h in hosted for x in h.read],
            "late": sum(h.late for h in hosted),
            "ticks": sum(h.ticks for h in hosted),
            "proposed": [h.proposed_at for h in hosted if h.proposed_at],
            "saw": [h.saw_at for h in hosted if h.saw_at],
            "all_saw": all(h.saw_at for h in hosted if h.rank != cfg["n"] - 1),
        }
    )


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def measure(n: int, mode: str, timeout: float, procs: int) -> dict[str, Any]:
    """One run: N virtual ranks, one fault (``stall`` or ``kill``) on the last rank."""
    ctx = mp.get_context("spawn")
    port, ready, stop, out = _free_port(), ctx.Event(), ctx.Event(), ctx.Queue()
    server = ctx.Process(target=_serve, args=(port, ready, stop))
    server.start()
    ready.wait(30)
    tick = tick_interval(timeout)
    run_s = FAULT_AT_S + timeout + 10.0
    cfg = {"port": port, "prefix": f"tg/{mode}", "n": n, "timeout": timeout, "tick": tick}
    cfg.update(mode=mode, run_s=run_s)
    clients = [
        ctx.Process(target=_client, args=(list(range(p, n, procs)), cfg, out)) for p in range(procs)
    ]
    setup = time.time()
    for c in clients:
        c.start()
    control = TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=600))
    while control.add("connected", 0) < n:
        time.sleep(0.2)
    setup = time.time() - setup
    t0 = time.time() + 1.0
    cpu0 = _cpu_seconds(server.pid or 0)
    control.set("t0", repr(t0))
    results = [out.get(timeout=run_s + 600) for _ in clients]
    wall = time.time() - t0
    cpu = _cpu_seconds(server.pid or 0) - cpu0
    for c in clients:
        c.join(30)
    stop.set()
    server.join(10)
    return _summary(n, mode, timeout, tick, results, wall, cpu, setup, t0)


def _summary(
    n: int,
    mode: str,
    timeout: float,
    tick: float,
    results: list[dict[str, Any]],
    wall: float,
    cpu: float,
    setup: float,
    t0: float,
) -> dict[str, Any]:
    pub = [x for r in results for x in r["pub"]]
    read = [x for r in results for x in r["read"]]
    ticks = sum(r["ticks"] for r in results)
    proposed = [x for r in results for x in r["proposed"]]
    saw = [x for r in results for x in r["saw"]]
    fault = t0 + FAULT_AT_S
    return {
        "n": n,
        "mode": mode,
        "timeout": timeout,
        "tick": tick,
        "setup_s": round(setup, 1),
        "ticks": ticks,
        "late": sum(r["late"] for r in results),
        "ticks_per_rank_s": round(ticks / n / wall, 3),
        "requests_per_s": round(2 * ticks / wall),
        "keys_read_per_s": round(ticks * (n + 1) / wall),
        "pub_p50_ms": round(_pct(pub, 0.5), 2),
        "pub_p99_ms": round(_pct(pub, 0.99), 2),
        "read_p50_ms": round(_pct(read, 0.5), 2),
        "read_p99_ms": round(_pct(read, 0.99), 2),
        "detect_s": round(min(proposed) - fault, 2) if proposed else None,
        "all_saw_s": round(max(saw) - fault, 2)
        if saw and all(r["all_saw"] for r in results)
        else None,
        "server_cores": round(cpu / wall, 2),
    }


COLUMNS = [
    "n",
    "mode",
    "ticks_per_rank_s",
    "late",
    "requests_per_s",
    "keys_read_per_s",
    "pub_p50_ms",
    "pub_p99_ms",
    "read_p50_ms",
    "read_p99_ms",
    "detect_s",
    "all_saw_s",
    "server_cores",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--modes", nargs="+", default=["stall", "kill"])
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--out", default="runs/benchmarks/watchdog_scale.json")
    args = parser.parse_args()
    soft = _raise_fd_limit(16384)
    print(f"fd soft limit {soft}; timeout {args.timeout} s, tick {tick_interval(args.timeout)} s")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    rows = []
    for n in args.sizes:
        for mode in args.modes:
            row = measure(n, mode, args.timeout, args.procs)
            rows.append(row)
            print("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"setup seconds (connecting N clients): {[r['setup_s'] for r in rows]}")
    print(f"median tick of all rows: {statistics.median(r['tick'] for r in rows)}")


if __name__ == "__main__":
    main()
