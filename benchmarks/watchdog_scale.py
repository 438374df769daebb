"""The hang watchdog's store traffic at scale: N virtual ranks against one real TCPStore.

One process serves a ``torch.distributed.TCPStore`` (its CPU time is read from
``/proc/<pid>/stat``). ``--procs`` client processes each host N/procs virtual ranks, one
thread each; every virtual rank is a real ``trainguard.hang.watchdog.Watchdog`` with its own
TCPStore connection (as a real rank's watchdog thread has), driven by calling its
``tick_once`` on the watchdog's own cadence, so the store sees exactly the watchdog's
requests. Only the exit is replaced: ``exit_fn`` records the time instead of ending the
process, and the stack dump is a no-op (a dump of a process with 1,000 threads, 4,096 times,
would measure the dump, not the store). Two designs (``--design``):

* ``full``: every rank reads every heartbeat (the design before watchers);
* ``watchers``: the default (``trainguard.hang.watchers``): 2 watcher ranks read all, the
  others read the watchers' heartbeats and the verdict.

Cadence: ``--timeout 10`` gives tick 1.0 s (the default tick: the grace and learned
timeouts also tick every second) and dead_after 10 s. Two faults per N, on the last rank:

* ``stall``: it stops in ``data`` at step s; the others stop in ``check`` of step s (they
  wait for it in a collective); every heartbeat goes on. Expected: a hang naming it.
* ``kill``: its watchdog stops right after a heartbeat (a killed process); the others go on.
  Expected: a peer failure naming it.

Each rank ticks at its own phase within the tick (real ranks are not in lockstep).
``detect`` = the deciding rank's act time minus the fault time (when the faulty rank
stalled or died); ``all_saw`` = the last surviving rank's; ``ok`` = every survivor acted on
one verdict of the right kind naming the faulty rank. ``late`` counts ticks that began more
than half a tick late (client overload: the clients share the machine's cores with the
server). ``ops/s`` and ``MB/s`` are the
requests the store served and the bytes of values it returned (counted on the client side).

    python benchmarks/watchdog_scale.py                  # both designs, N = 64 256 1024 4096
    python benchmarks/watchdog_scale.py --sizes 64 --design watchers
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, markdown_table, now_iso, write_json
from _scale_store import (
    HOST,
    CountingStore,
    collect,
    cpu_seconds,
    free_port,
    pct,
    probe_full,
    raise_fd_limit,
    serve,
)

from trainguard.events import EventLog
from trainguard.hang import exit_path
from trainguard.hang.channel import StoreChannel
from trainguard.hang.timeout import TimeoutLearner, dead_after, tick_interval
from trainguard.hang.watchdog import Watchdog
from trainguard.hang.watchers import DEFAULT_WATCHERS, select_watchers
from trainguard.progress import Progress

FAULT_AT_S = 3.0
"""Seconds after the common start at which the fault happens."""


class VirtualRank:
    """One rank: a real ``Watchdog`` on its own store connection, ticked on schedule."""

    def __init__(self, rank: int, cfg: dict[str, Any], run_dir: Path) -> None:
        n = cfg["n"]
        connection = TCPStore(HOST, cfg["port"], is_master=False, timeout=timedelta(seconds=60))
        self.store = CountingStore(connection)
        members = list(range(n))
        channel = StoreChannel(self.store, cfg["prefix"], rank, members)
        self.rank, self.cfg, self.progress = rank, cfg, Progress()
        self.acted: tuple[float, int, list[int], str] | None = None
        self.late = self.ticks = 0
        self.tick_cpu: list[float] = []
        self.fault_time: float | None = None
        """When the faulty rank stalled or died (unix time)."""
        """CPU seconds of each ``tick_once`` (this thread's own, not the time it waited)."""
        self.t0 = 0.0
        self.wd = Watchdog(
            channel=channel,
            main_channel=channel,
            progress=self.progress,
            events=EventLog(run_dir, rank),
            run_dir=run_dir,
            learner=TimeoutLearner(fixed=cfg["timeout"]),
            store_host=None,
            exit_fn=self._exited,
            install_hooks=False,
            faulthandler_fallback=False,
            ack_wait_s=0.0,
            watchers=cfg["watchers"],
        )
        self.progress.enter("step", 0)
        self.wd.start(thread=False)

    def _exited(self, code: int) -> None:
        verdict = self.wd.verdict
        assert verdict is not None  # the exit path sets it before exiting
        self.acted = (time.time(), verdict.by, list(verdict.culprits), verdict.kind)

    def run(self, t0: float) -> None:
        cfg, tick = self.cfg, self.cfg["tick"]
        faulty = self.rank == cfg["n"] - 1
        fault_at, end = t0 + FAULT_AT_S, t0 + cfg["run_s"]
        fault_step = int(FAULT_AT_S / tick)
        offset = tick * self.rank / cfg["n"]  # ranks do not tick in lockstep
        k = 0
        while self.acted is None:
            k += 1
            scheduled = t0 + offset + k * tick
            time.sleep(max(0.0, scheduled - time.time()))
            now = time.time()
            if now > end:
                return
            if now < fault_at or cfg["mode"] == "kill":
                self.progress.enter("step", k)
            elif self.progress.step != fault_step:  # the stall: everyone stops at one step
                self.progress.enter("data" if faulty else "check", fault_step)
                self.fault_time = self.fault_time or (now if faulty else None)
            self.late += now - scheduled > tick / 2
            self.ticks += 1
            cpu = time.thread_time()
            self.wd.tick_once()
            self.tick_cpu.append(time.thread_time() - cpu)
            if faulty and now >= fault_at and cfg["mode"] == "kill":
                self.fault_time = time.time()
                return  # killed right after its last heartbeat (the slowest case to detect)


def _client(ranks: list[int], cfg: dict[str, Any], out: Any) -> None:
    raise_fd_limit(16384)
    if not set(ranks) & set(cfg["watchers"]):
        # Linux shares the CPU per thread: 4,000 ranks' threads would starve the 2 watcher
        # threads, which on a real job share their CPU only with their own rank.
        os.nice(10)
    exit_path.write_stack_dump = lambda path, header: False  # type: ignore[attr-defined]
    logging.getLogger("trainguard").addHandler(logging.NullHandler())  # N exit lines
    logging.getLogger("trainguard").propagate = False
    with tempfile.TemporaryDirectory(prefix="tg-scale-") as run_dir:
        _run_client(ranks, cfg, out, Path(run_dir))


def _run_client(ranks: list[int], cfg: dict[str, Any], out: Any, run_dir: Path) -> None:
    with ThreadPoolExecutor(64) as pool:  # a connection may wait on a reverse DNS lookup
        hosted = list(pool.map(lambda r: VirtualRank(r, cfg, run_dir), ranks))
    control = TCPStore(HOST, cfg["port"], is_master=False, timeout=timedelta(seconds=600))
    control.add("connected", len(hosted))
    t0 = float(control.get("t0").decode())
    for h in hosted:  # count only the measured window
        h.store.ops = h.store.bytes = h.store.keys = 0
        h.store.set_s.clear()
        h.store.read_s.clear()
    threads = [threading.Thread(target=h.run, args=(t0,), daemon=True) for h in hosted]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    watchers = set(cfg["watchers"])
    out.put(
        {
            "pub": [x for h in hosted for x in h.store.set_s],
            "read_w": [x for h in hosted if h.rank in watchers for x in h.store.read_s],
            "read_o": [x for h in hosted if h.rank not in watchers for x in h.store.read_s],
            "cpu_w": [x for h in hosted if h.rank in watchers for x in h.tick_cpu],
            "cpu_o": [x for h in hosted if h.rank not in watchers for x in h.tick_cpu],
            "ops": sum(h.store.ops for h in hosted),
            "bytes": sum(h.store.bytes for h in hosted),
            "keys": sum(h.store.keys for h in hosted),
            "late": sum(h.late for h in hosted),
            "ticks": sum(h.ticks for h in hosted),
            "acted": {h.rank: h.acted for h in hosted if h.acted},
            "fault_time": max([h.fault_time for h in hosted if h.fault_time] or [0.0]),
        }
    )


def _placement(n: int, watchers: list[int], procs: int) -> list[list[int]]:
    """The virtual ranks of each client process: in the watchers design each watcher has a
    process of its own (a real watcher's thread shares its GIL only with its own training
    thread, not with 1,000 other ranks), the others are dealt round-robin to ``procs``."""
    if len(watchers) == n:
        return [list(range(p, n, procs)) for p in range(procs)]
    others = [r for r in range(n) if r not in set(watchers)]
    return [[w] for w in watchers] + [others[p::procs] for p in range(procs)]


def measure(n: int, design: str, mode: str, timeout: float, procs: int) -> dict[str, Any]:
    """One run: N virtual ranks, one fault (``stall`` or ``kill``) on the last rank."""
    ctx = mp.get_context("fork")  # no torch import per client: 2 s each on 2 cores
    port, ready, stop, out = free_port(), ctx.Event(), ctx.Event(), ctx.Queue()
    server = ctx.Process(target=serve, args=(port, ready, stop), daemon=True)
    server.start()
    ready.wait(30)
    tick = tick_interval(timeout)
    watchers = list(range(n)) if design == "full" else select_watchers(range(n), DEFAULT_WATCHERS)
    cfg: dict[str, Any] = {
        "port": port,
        "prefix": f"tg/{mode}",
        "n": n,
        "timeout": timeout,
        "tick": tick,
    }
    cfg.update(mode=mode, run_s=FAULT_AT_S + timeout + 20.0, watchers=watchers)
    clients = [
        ctx.Process(target=_client, args=(ranks, cfg, out), daemon=True)
        for ranks in _placement(n, watchers, procs)
    ]
    setup = time.time()
    try:
        for c in clients:
            c.start()
        control = TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=600))
        while control.add("connected", 0) < n:
            time.sleep(0.2)
        setup = time.time() - setup
        t0 = time.time() + 1.0
        cpu0 = cpu_seconds(server.pid or 0)
        control.set("t0", repr(t0))
        results = collect(out, len(clients), t0 + cfg["run_s"] + 30.0)
        wall = time.time() - t0
        cpu = cpu_seconds(server.pid or 0) - cpu0
    finally:
        for p in [*clients, server]:
            p.terminate()
            p.join(10)
    row = _summary(cfg, design, results, wall, cpu, t0)
    row["setup_s"] = round(setup, 1)
    row["finished_clients"] = f"{len(results)}/{len(clients)}"
    return row


def _summary(
    cfg: dict[str, Any],
    design: str,
    results: list[dict[str, Any]],
    wall: float,
    cpu: float,
    t0: float,
) -> dict[str, Any]:
    n, mode = cfg["n"], cfg["mode"]
    acted: dict[int, tuple[float, int, list[int], str]] = {}
    for r in results:
        acted.update(r["acted"])
    fault = max([r["fault_time"] for r in results] + [0.0]) or t0 + FAULT_AT_S
    deciders = [a[0] for rank, a in acted.items() if a[1] == rank]
    survivors = n - 1 if mode == "kill" else n
    kind = "peer_failure" if mode == "kill" else "hang"
    ok = len(acted) == survivors and all(a[2] == [n - 1] and a[3] == kind for a in acted.values())
    ticks = sum(r["ticks"] for r in results)
    return {
        "design": design,
        "n": n,
        "mode": mode,
        "watchers": len(cfg["watchers"]),
        "ticks": ticks,
        "late": sum(r["late"] for r in results),
        "ops_per_s": round(sum(r["ops"] for r in results) / wall),
        "keys_per_s": round(sum(r["keys"] for r in results) / wall),
        "mb_per_s": round(sum(r["bytes"] for r in results) / wall / 1e6, 2),
        "server_cpu_pct": round(100.0 * cpu / wall, 1),
        "write_p50_ms": pct([x for r in results for x in r["pub"]], 0.5),
        "write_p99_ms": pct([x for r in results for x in r["pub"]], 0.99),
        "detector_read_p50_ms": pct([x for r in results for x in r["read_w"]], 0.5),
        "detector_read_p99_ms": pct([x for r in results for x in r["read_w"]], 0.99),
        "other_read_p50_ms": pct([x for r in results for x in r["read_o"]], 0.5),
        "watcher_tick_cpu_ms": pct([x for r in results for x in r["cpu_w"]], 0.5),
        "other_tick_cpu_ms": pct([x for r in results for x in r["cpu_o"]], 0.5),
        "detect_s": round(min(deciders) - fault, 2) if deciders else None,
        "all_saw_s": round(max(a[0] for a in acted.values()) - fault, 2) if ok else None,
        "ok": ok,
        "acted": f"{len(acted)}/{survivors}",
        "timeout": cfg["timeout"],
        "dead_after": dead_after(cfg["timeout"]),
        "tick": cfg["tick"],
        "wall_s": round(wall, 1),
    }


COLUMNS = [
    "design", "n", "mode", "late", "ops_per_s", "keys_per_s", "mb_per_s", "server_cpu_pct",
    "write_p50_ms", "write_p99_ms", "detector_read_p50_ms", "detector_read_p99_ms",
    "watcher_tick_cpu_ms", "other_tick_cpu_ms", "detect_s", "all_saw_s", "ok", "acted",
    "finished_clients",
]  # fmt: skip


def _table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(COLUMNS, [[row.get(c) for c in COLUMNS] for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--design", choices=["full", "watchers", "both"], default="both")
    parser.add_argument("--modes", nargs="+", default=["stall", "kill"])
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument(
        "--full-max",
        type=int,
        default=256,
        help="above this N the full design is measured by a store probe (see probe_full)",
    )
    parser.add_argument("--out", default="runs/benchmarks/watchdog_scale.json")
    args = parser.parse_args()
    soft = raise_fd_limit(16384)
    # c10d formats every socket's peer address with a reverse lookup; where no DNS answers
    # (sandboxes), glibc's default 5 s x 2 attempts makes connecting N clients take minutes.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    designs = ["full", "watchers"] if args.design == "both" else [args.design]
    command = "python " + " ".join(sys.argv)
    print(
        f"{command}\nfd limit {soft}; timeout {args.timeout}s, tick {tick_interval(args.timeout)}s"
    )
    machine = machine_info()
    started = time.time()
    rows = []
    for n in args.sizes:
        for design in designs:
            for mode in args.modes:
                if design == "full" and n > args.full_max:
                    if mode != args.modes[0]:
                        continue
                    rows.append(probe_full(n, args.timeout, args.procs))
                else:
                    rows.append(measure(n, design, mode, args.timeout, args.procs))
                print(_table(rows[-1:]).splitlines()[-1], flush=True)
                write_json(
                    Path(args.out), {"time": now_iso(), "command": command, **{"rows": rows}}
                )
    print()
    print(_table(rows))
    machine["load_average_after"] = machine_info()["load_average"]
    write_json(
        Path(args.out), {"time": now_iso(), "command": command, "machine": machine, "rows": rows}
    )
    print(f"wrote {args.out}; {time.time() - started:.0f} s in all")


if __name__ == "__main__":
    main()
