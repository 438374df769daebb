"""Does the hang watchdog scale: N ranks' heartbeats against one real c10d TCPStore?

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

The one benchmark that imports trainguard's internals (the ``Watchdog`` and its store
channel, driven without a training loop): see the import block below.

    python benchmarks/watchdog_scale.py                  # both designs, N = 64 256 1024 4096
    python benchmarks/watchdog_scale.py --sizes 64 --design watchers
    python benchmarks/watchdog_scale.py --quick          # N = 8, watchers, 2 s timeout
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import resource
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
from _common import finish, finish_args, free_port, header, markdown_table, parser, quick_dns

# trainguard's internals: the watchdog and its store channel, driven tick by tick without a
# training loop (no public API runs 4,096 ranks' watchdogs in one machine's processes).
from trainguard.events import EventLog
from trainguard.hang import exit_path
from trainguard.hang.channel import StoreChannel
from trainguard.hang.progress import Progress
from trainguard.hang.timeout import TimeoutLearner, dead_after, tick_interval
from trainguard.hang.watchdog import Watchdog
from trainguard.hang.watchers import DEFAULT_WATCHERS, select_watchers

NAME = "watchdog_scale"

# -- the store: one server process, client connections that count what they ask ---------------

HOST = "127.0.0.1"


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


# -- the virtual ranks -----------------------------------------------------------------------


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
        fault_at, end = t0 + cfg["fault_at"], t0 + cfg["run_s"]
        fault_step = int(cfg["fault_at"] / tick)
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


def measure(
    n: int, design: str, mode: str, timeout: float, procs: int, fault_at: float
) -> dict[str, Any]:
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
    cfg.update(mode=mode, fault_at=fault_at, run_s=fault_at + timeout + 20.0, watchers=watchers)
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
        t0 = time.time() + min(1.0, cfg["fault_at"])  # the clients read it first
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
    fault = max([r["fault_time"] for r in results] + [0.0]) or t0 + cfg["fault_at"]
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


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, rounds=1, quick_rounds=1, warmup=0, device=False)
    p.add_argument("--sizes", type=int, nargs="+", help="N (default 64 256 1024 4096; 8 --quick)")
    p.add_argument("--design", choices=["full", "watchers", "both"], help="default both")
    p.add_argument("--modes", nargs="+", default=["stall", "kill"])
    p.add_argument("--timeout", type=float, help="hang_timeout, s (default 10; 2 with --quick)")
    p.add_argument("--procs", type=int, help="client processes (default 4; 2 with --quick)")
    p.add_argument("--fault-at", type=float, help="s from the start (default 3; 0.5 --quick)")
    p.add_argument(
        "--full-max",
        type=int,
        default=256,
        help="above this N the full design is measured by a store probe (see probe_full)",
    )
    args = p.parse_args(argv)
    finish_args(p, args, NAME)
    quick = args.quick
    sizes = args.sizes or ([8] if quick else [64, 256, 1024, 4096])
    design = args.design or ("watchers" if quick else "both")
    timeout = args.timeout or (2.0 if quick else 10.0)
    procs = args.procs or (2 if quick else 4)
    fault_at = args.fault_at or (0.5 if quick else 3.0)
    soft = raise_fd_limit(16384)
    quick_dns()  # else connecting N clients can take minutes where no DNS answers
    designs = ["full", "watchers"] if design == "both" else [design]
    settings = {
        "sizes": sizes,
        "designs": designs,
        "modes": args.modes,
        "timeout": timeout,
        "tick": tick_interval(timeout),
        "procs": procs,
        "fault_at": fault_at,
        "fd_limit": soft,
    }
    report = header(NAME, argv, settings)
    print(f"fd limit {soft}; timeout {timeout} s, tick {tick_interval(timeout)} s", file=sys.stderr)
    started = time.time()
    rows: list[dict[str, Any]] = []
    for n in sizes:
        for d in designs:
            for mode in args.modes:
                if d == "full" and n > args.full_max:
                    if mode != args.modes[0]:
                        continue
                    rows.append(probe_full(n, timeout, procs))
                else:
                    rows.append(measure(n, d, mode, timeout, procs, fault_at))
                print(_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(_table(rows))
    report["rows"] = rows
    report["wall_s"] = round(time.time() - started, 1)
    finish(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
