"""The rendezvous variables a launcher sets, checked before anything waits on them.

``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` consistent, ``MASTER_ADDR``
resolvable (in a thread with a timeout: DNS can hang), ``MASTER_PORT`` free where this process
would host the store, reachable where it would connect to it (with a timeout)."""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainguard.distributed.elastic import RESTART_HAZARD_FIX, restart_store_hazard
from trainguard.doctor.findings import Finding

RANK_VARS = ("RANK", "WORLD_SIZE")
LOCAL_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")
RETRY_S = 0.25
LAUNCH_FIX = "launch with torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE"


@dataclass(frozen=True)
class Launch:
    """Where this process sits in the job, from the launcher's variables."""

    rank: int | None = None
    world_size: int = 1
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    agent_store: bool = False
    """torchrun's agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE=True``)."""
    torchrun: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def hosts_store(self) -> bool:
        """This process would start the TCPStore server (rank 0, or a single process)."""
        return (self.rank or 0) == 0 and not self.agent_store


def read_launch(env: Mapping[str, str]) -> tuple[Launch | None, list[Finding]]:
    """The launch, or None with the findings that make it unusable."""
    numbers, findings = _integers(env, (*RANK_VARS, *LOCAL_VARS, "MASTER_PORT"))
    if findings:
        return None, findings
    findings = _consistency(env, numbers)
    if any(f.status == "fail" for f in findings):
        return None, findings
    launch = Launch(
        rank=numbers.get("RANK"),
        world_size=numbers.get("WORLD_SIZE", 1),
        local_rank=numbers.get("LOCAL_RANK"),
        local_world_size=numbers.get("LOCAL_WORLD_SIZE"),
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=numbers.get("MASTER_PORT"),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        torchrun="TORCHELASTIC_RUN_ID" in env,
    )
    findings.append(
        Finding("rendezvous.launch", "ok" if launch.distributed else "info", _describe(launch))
    )
    hazard = restart_store_hazard(env)
    if hazard is not None:
        findings.append(Finding("rendezvous.restart_store", "warn", hazard, RESTART_HAZARD_FIX))
    return launch, findings


def _integers(
    env: Mapping[str, str], names: tuple[str, ...]
) -> tuple[dict[str, int], list[Finding]]:
    numbers: dict[str, int] = {}
    findings: list[Finding] = []
    for name in names:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            numbers[name] = int(raw)
        except ValueError:
            findings.append(
                Finding(
                    f"rendezvous.{name}", "fail", f"{name}={raw!r} is not an integer", LAUNCH_FIX
                )
            )
            continue
        low = 1 if name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT") else 0
        if not low <= numbers[name] <= (65535 if name == "MASTER_PORT" else 1 << 31):
            findings.append(
                Finding(f"rendezvous.{name}", "fail", f"{name}={raw} is out of range", LAUNCH_FIX)
            )
    return numbers, findings


def _consistency(env: Mapping[str, str], n: dict[str, int]) -> list[Finding]:
    def fail(what: str, fix: str = LAUNCH_FIX) -> Finding:
        return Finding("rendezvous.consistency", "fail", what, fix)

    out: list[Finding] = []
    rank_set = [v for v in RANK_VARS if v in n]
    local_set = [v for v in LOCAL_VARS if v in n]
    if len(rank_set) == 1 or (local_set and not rank_set):
        unset = [v for v in (*RANK_VARS, *LOCAL_VARS) if v not in n]
        out.append(
            fail(
                f"{', '.join(rank_set + local_set)} set but {', '.join(unset)} not: "
                "a launcher sets all of them"
            )
        )
        return out
    if "RANK" in n and n["RANK"] >= n["WORLD_SIZE"]:
        out.append(
            fail(f"RANK={n['RANK']} but WORLD_SIZE={n['WORLD_SIZE']}: ranks run 0..WORLD_SIZE-1")
        )
    if len(local_set) == 2 and n["LOCAL_RANK"] >= n["LOCAL_WORLD_SIZE"]:
        out.append(
            fail(f"LOCAL_RANK={n['LOCAL_RANK']} but LOCAL_WORLD_SIZE={n['LOCAL_WORLD_SIZE']}")
        )
    if len(local_set) == 2 and "WORLD_SIZE" in n and n["LOCAL_WORLD_SIZE"] > n["WORLD_SIZE"]:
        out.append(fail(f"LOCAL_WORLD_SIZE={n['LOCAL_WORLD_SIZE']} > WORLD_SIZE={n['WORLD_SIZE']}"))
    if len(local_set) == 1:
        missing = next(v for v in LOCAL_VARS if v not in n)
        out.append(
            Finding(
                "rendezvous.consistency",
                "warn",
                f"{local_set[0]} set but {missing} not: the doctor cannot check GPUs per host",
                LAUNCH_FIX,
            )
        )
    if n.get("WORLD_SIZE", 1) > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name):
                out.append(
                    fail(
                        f"WORLD_SIZE={n['WORLD_SIZE']} but {name} is not set: ranks cannot meet",
                        f"set {name} (torchrun sets it from --master-addr/--master-port or "
                        "--rdzv-endpoint)",
                    )
                )
    return out


def _describe(launch: Launch) -> str:
    if not launch.distributed and launch.rank is None:
        return "single process (no RANK/WORLD_SIZE): run under torchrun for the cross-rank checks"
    local = ""
    if launch.local_rank is not None:
        local = f", local rank {launch.local_rank} of {launch.local_world_size}"
    how = "torchrun" if launch.torchrun else "launcher variables"
    return f"rank {launch.rank} of {launch.world_size}{local} ({how})"


def resolve(host: str, port: int | None, timeout_s: float) -> tuple[list[str], str | None, float]:
    """``host``'s addresses, an error (None when it resolved), and the seconds it took.
    ``getaddrinfo`` runs in a daemon thread: a resolver that hangs costs ``timeout_s``, no more."""
    result: list[Any] = []
    start = time.monotonic()

    def lookup() -> None:
        try:
            result.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as exc:
            result.append(exc)

    thread = threading.Thread(target=lookup, name="trainguard-doctor-dns", daemon=True)
    thread.start()
    thread.join(timeout_s)
    elapsed = time.monotonic() - start
    if not result:
        return [], f"no answer within {timeout_s:g} s (the resolver hangs)", elapsed
    if isinstance(result[0], Exception):
        return [], str(result[0]), elapsed
    addresses = sorted({str(info[4][0]) for info in result[0]})
    return addresses, None, elapsed


def check_master(launch: Launch, timeout_s: float) -> tuple[dict[str, Any], list[Finding]]:
    """MASTER_ADDR resolves; MASTER_PORT is free (host) or reachable (client)."""
    info: dict[str, Any] = {"master_addr": launch.master_addr, "master_port": launch.master_port}
    if launch.master_addr is None:
        return info, []
    addr = launch.master_addr
    addresses, error, took = resolve(addr, launch.master_port, timeout_s)
    info.update(addresses=addresses, resolve_s=round(took, 3))
    if error is not None:
        fix = (
            "set MASTER_ADDR to the host name or IP address of the node running rank 0 "
            f"(check it with: getent hosts {addr})"
        )
        message = f"MASTER_ADDR={addr!r} does not resolve: {error}"
        return info, [Finding(MASTER_ADDR, "fail", message, fix)]
    resolved = f"MASTER_ADDR={addr} resolves to {', '.join(addresses)} ({took * 1000:.0f} ms)"
    findings = [Finding(MASTER_ADDR, "ok", resolved)]
    if launch.master_port is not None:
        check = _check_host_port if launch.hosts_store else _check_client_port
        port_info, finding = check(launch, addresses, timeout_s)
        info.update(port_info)
        findings.append(finding)
    return info, findings


MASTER_ADDR = "rendezvous.master_addr"
MASTER_PORT = "rendezvous.master_port"


def _check_host_port(
    launch: Launch, addresses: list[str], timeout_s: float
) -> tuple[dict[str, Any], Finding]:
    """Rank 0 (or a lone process) starts the TCPStore: MASTER_ADDR must be this host, and
    MASTER_PORT free on it."""
    port, addr = launch.master_port, launch.master_addr
    info: dict[str, Any] = {"port_role": "host"}
    if not any(is_local_address(a) for a in addresses):
        message = (
            f"this process is rank {launch.rank or 0}, which hosts the store, but MASTER_ADDR="
            f"{addr} ({', '.join(addresses)}) is not an address of this host"
        )
        fix = "run rank 0 on the MASTER_ADDR host, or set MASTER_ADDR to this host's address"
        return info, Finding(MASTER_ADDR, "fail", message, fix)
    error = port_in_use(port or 0)
    info["port_free"] = error is None
    if error is not None:
        fix = f"pick a free port, or find who holds it: ss -ltnp 'sport = :{port}'"
        return info, Finding(
            MASTER_PORT, "fail", f"MASTER_PORT={port} is taken here ({error})", fix
        )
    return info, Finding(
        MASTER_PORT, "ok", f"MASTER_PORT={port} is free here (rank 0 hosts the store)"
    )


def _check_client_port(
    launch: Launch, addresses: list[str], timeout_s: float
) -> tuple[dict[str, Any], Finding]:
    """Other ranks (all ranks under torchrun's agent store) connect to MASTER_ADDR:MASTER_PORT."""
    port, addr = launch.master_port or 0, launch.master_addr
    owner = "torchrun's agent" if launch.agent_store else "rank 0"
    error, took = connect(addresses[0], port, timeout_s)
    info: dict[str, Any] = {"port_role": "client", "port_reachable": error is None}
    if error is not None:
        message = (
            f"nothing answers at MASTER_ADDR:MASTER_PORT={addr}:{port} after {took:.1f} s "
            f"({error}); {owner} should be listening there"
        )
        fix = f"start {owner} first, or check the address and the firewall: nc -zv {addr} {port}"
        return info, Finding(MASTER_PORT, "fail", message, fix)
    message = f"{addr}:{port} answers ({owner} hosts the store; {took * 1000:.0f} ms)"
    return info, Finding(MASTER_PORT, "ok", message)


def is_local_address(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def port_in_use(port: int) -> str | None:
    """None when a server could listen on ``port`` (as TCPStore does: all interfaces)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def connect(address: str, port: int, timeout_s: float) -> tuple[str | None, float]:
    """Connect, retrying refusals until ``timeout_s`` (the server may start a moment later)."""
    start = time.monotonic()
    deadline = start + timeout_s
    error = "timed out"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return error, time.monotonic() - start
        try:
            with socket.create_connection((address, port), timeout=min(left, 5.0)):
                return None, time.monotonic() - start
        except OSError as exc:
            error = exc.strerror or str(exc)
            if exc.errno not in (errno.ECONNREFUSED, errno.ECONNRESET, None):
                return error, time.monotonic() - start
        time.sleep(min(RETRY_S, max(0.0, deadline - time.monotonic())))
