"""The store side of ``watchdog_scale.py``: one TCPStore server process, client connections
that count what they ask of it, and a probe of the full design's read load.

Not a package module: ``watchdog_scale.py`` imports it from this folder.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import resource
import socket
import threading
import time
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]

from trainguard.hang.timeout import tick_interval

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def raise_fd_limit(wanted: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        soft = min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def serve(port: int, ready: Any, stop: Any) -> None:
    raise_fd_limit(16384)
    store = TCPStore(HOST, port, is_master=True, wait_for_workers=False)
    ready.set()
    stop.wait()
    del store


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CountingStore:
    """A TCPStore connection that counts requests and returned bytes and times the
    heartbeat write (``set``) and the heartbeat read (``multi_get``)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.ops = 0
        self.bytes = 0
        self.keys = 0
        self.set_s: list[float] = []
        self.read_s: list[float] = []

    def set(self, key: str, value: str) -> None:
        a = time.perf_counter()
        self.store.set(key, value)
        self.set_s.append(time.perf_counter() - a)
        self.ops += 1

    def multi_get(self, keys: list[str]) -> list[bytes]:
        a = time.perf_counter()
        values: list[bytes] = self.store.multi_get(keys)
        self.read_s.append(time.perf_counter() - a)
        self.ops += 1
        self.keys += len(keys)
        self.bytes += sum(len(v) for v in values)
        return values

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        self.ops += 1
        value: bytes = self.store.compare_set(key, expected_value, desired_value)
        return value

    def add(self, key: str, value: int) -> int:
        self.ops += 1
        return int(self.store.add(key, value))

    def check(self, keys: list[str]) -> bool:
        self.ops += 1
        return bool(self.store.check(keys))

    def get(self, key: str) -> bytes:
        self.ops += 1
        value: bytes = self.store.get(key)
        return value


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2)


def _probe_client(cfg: dict[str, Any], threads: int, out: Any) -> None:
    """Threads that each repeat one full read (every heartbeat and the verdict) until the
    deadline: what a full-design rank asks of the store every tick."""
    keys = [f"tg/probe/hb/{r}" for r in range(cfg["n"])] + ["tg/probe/verdict"]
    stores = [CountingStore(TCPStore(HOST, cfg["port"], is_master=False)) for _ in range(threads)]

    def loop(store: CountingStore) -> None:
        while time.time() < cfg["end"]:
            store.multi_get(keys)

    workers = [threading.Thread(target=loop, args=(s,)) for s in stores]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    reads = [x for s in stores for x in s.read_s]
    out.put({"reads": reads, "bytes": sum(s.bytes for s in stores)})


def probe_full(n: int, timeout: float, procs: int, seconds: float = 10.0) -> dict[str, Any]:
    """The full design's store load at ``n`` ranks, measured instead of simulated: 2 * procs
    connections repeat a full read (n + 1 keys) as fast as the store answers. The design
    needs n such reads per tick; the simulation would need n Python watchdogs each decoding
    n heartbeats a tick (and n * n heartbeats in memory), which this machine cannot host."""
    ctx = mp.get_context("fork")
    port, ready, stop, out = free_port(), ctx.Event(), ctx.Event(), ctx.Queue()
    server = ctx.Process(target=serve, args=(port, ready, stop), daemon=True)
    server.start()
    ready.wait(30)
    writer = TCPStore(HOST, port, is_master=False)
    beat = '{"seq":1,"step":1,"phase":"forward","beats":1,"user_phase":false,"timeout":10.0,'
    beat += '"state":"running","host":"node-0000.cluster","pid":123456}'
    for r in range(n):
        writer.set(f"tg/probe/hb/{r}", beat)
    writer.set("tg/probe/verdict", "")
    cfg = {"port": port, "n": n, "end": time.time() + 1.0 + seconds}
    clients = [
        ctx.Process(target=_probe_client, args=(cfg, 2, out), daemon=True) for _ in range(procs)
    ]
    try:
        cpu0, t0 = cpu_seconds(server.pid or 0), time.time()
        for c in clients:
            c.start()
        results = collect(out, procs, cfg["end"] + 30.0)
        wall, cpu = time.time() - t0, cpu_seconds(server.pid or 0) - cpu0
    finally:
        for p in [*clients, server]:
            p.terminate()
            p.join(10)
    reads = [x for r in results for x in r["reads"]]
    needed = n / tick_interval(timeout)
    return {
        "design": "full",
        "n": n,
        "mode": "probe",
        "ops_per_s": round(len(reads) / wall),
        "keys_per_s": round(len(reads) * (n + 1) / wall),
        "mb_per_s": round(sum(r["bytes"] for r in results) / wall / 1e6, 2),
        "server_cpu_pct": round(100.0 * cpu / wall, 1),
        "detector_read_p50_ms": pct(reads, 0.5),
        "detector_read_p99_ms": pct(reads, 0.99),
        "needed_reads_per_s": needed,
        "ok": len(reads) / wall >= needed,
        "acted": f"{len(reads) / wall / needed:.2f}x of the reads needed",
        "finished_clients": f"{len(results)}/{procs}",
        "timeout": timeout,
        "tick": tick_interval(timeout),
        "wall_s": round(wall, 1),
    }


def collect(out: Any, count: int, deadline: float) -> list[dict[str, Any]]:
    """The clients' results that arrive before ``deadline`` (a client that cannot keep up
    is cut off: the row then says how many finished)."""
    results: list[dict[str, Any]] = []
    while len(results) < count:
        try:
            results.append(out.get(timeout=max(0.1, deadline - time.time())))
        except queue.Empty:
            break
    return results
