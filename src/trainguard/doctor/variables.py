"""The NCCL, ProcessGroupNCCL, gloo and c10d variables that are set, what each does, and the
settings that put a job at risk.

Meanings follow torch's "ProcessGroupNCCL Environment Variables" page, the
``init_process_group`` docs and NCCL's "Environment Variables" page. NCCL's page says the
variables of its "Debugging" kind (forcing an algorithm or protocol, switching a transport off)
are workarounds to remove once the issue is solved: kept set they "may result in sub-optimal
behavior, crashes, or hangs". Those are ``warn`` here.
"""

from __future__ import annotations

import difflib
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from trainguard.doctor.findings import Finding, Status

PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_", "TORCH_GLOO_")
EXACT = ("TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL")

WORKAROUND_FIX = "unset it unless it works around a known problem (NCCL's docs: debugging only)"
Judgement = tuple[Status, str | None, str | None]
"""(status, what this value does, the fix)."""


@dataclass(frozen=True)
class Known:
    meaning: str
    judge: Callable[[str], Judgement] | None = None


def relevant(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of the table's families that are set, sorted by name."""
    names = (k for k in env if k.startswith(PREFIXES) or k in EXACT)
    return {name: env[name] for name in sorted(names)}


def _async_error_handling(value: str) -> Judgement:
    if value.strip() == "0":
        return (
            "warn",
            "0: no handling; a failed or timed-out NCCL collective leaves the job hanging",
            "unset it (torch's default 3 tears the process down) or set 1",
        )
    return "info", None, None


def _debug_level(value: str) -> Judgement:
    if value.upper() in ("OFF", "INFO"):
        return "info", None, None
    if value.upper() == "DETAIL":
        return "info", "DETAIL: every collective is checked across ranks (slow; debugging)", None
    return "fail", "torch refuses to start with this value", "use OFF, INFO or DETAIL"


def _nccl_debug(value: str) -> Judgement:
    if value.upper() in ("VERSION", "WARN", "INFO", "TRACE", "ABORT"):
        return "info", None, None
    return "warn", "not a level NCCL knows", "use VERSION, WARN, INFO or TRACE"


def _workaround(does: str) -> Callable[[str], Judgement]:
    def judge(value: str) -> Judgement:
        if value.strip() in ("", "0"):
            return "info", None, None
        return "warn", does, WORKAROUND_FIX

    return judge


def _forced(value: str) -> Judgement:
    return "warn", f"forced to {value!r}", WORKAROUND_FIX


def _positive_int(value: str) -> Judgement:
    try:
        number = int(value)
    except ValueError:
        return "warn", "not an integer", "set a whole number of entries, e.g. 2000"
    if number <= 0:
        return "info", "0: the flight recorder is off", None
    return "info", None, None


def _deprecated(new: str) -> Callable[[str], Judgement]:
    def judge(value: str) -> Judgement:
        return "info", f"deprecated name, still read; torch's name is {new}", f"rename to {new}"

    return judge


def _ifnames_nccl(value: str) -> Judgement:
    return _judge_ifnames(value, nccl_interfaces_match(value, local_interfaces()))


def _ifnames_gloo(value: str) -> Judgement:
    names = [n.strip() for n in value.split(",") if n.strip()]
    missing = [n for n in names if n not in local_interfaces()]
    if missing:
        return (
            "fail",
            f"no interface named {', '.join(missing)} on this host",
            f"use interfaces this host has ({', '.join(local_interfaces())})",
        )
    return "info", None, None


def _judge_ifnames(value: str, matched: list[str]) -> Judgement:
    if matched:
        return "info", f"selects {', '.join(matched)} here", None
    return (
        "fail",
        "matches no interface of this host: NCCL cannot open its sockets",
        f"use interfaces this host has ({', '.join(local_interfaces())}), or unset it",
    )


KNOWN: dict[str, Known] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": Known(
        "what the NCCL watchdog does on an error or timeout: 0 nothing, 1 abort the communicator "
        "and tear the process down, 2 abort the communicator only, 3 tear down without aborting "
        "(torch's default)",
        _async_error_handling,
    ),
    "TORCH_NCCL_BLOCKING_WAIT": Known(
        "1: wait() blocks the calling thread until the collective ends or times out, then raises"
    ),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": Known(
        "dump the flight recorder on a watchdog timeout or error (needs a trace buffer > 0)"
    ),
    "TORCH_NCCL_TRACE_BUFFER_SIZE": Known(
        "entries in the flight recorder's ring buffer (0: off)", _positive_int
    ),
    "TORCH_FR_BUFFER_SIZE": Known(
        "entries in the flight recorder's ring buffer (newer name of TORCH_NCCL_TRACE_BUFFER_SIZE)",
        _positive_int,
    ),
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": Known("path prefix of the flight recorder's dumps"),
    "TORCH_FR_DUMP_TEMP_FILE": Known("path prefix of the flight recorder's dumps (newer name)"),
    "TORCH_NCCL_DESYNC_DEBUG": Known("on a timeout, report which rank is behind (desync debug)"),
    "TORCH_NCCL_ENABLE_TIMING": Known("record start events of every collective for timing"),
    "TORCH_NCCL_ENABLE_MONITORING": Known(
        "1: a monitor thread kills the process when the NCCL watchdog itself is stuck"
    ),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": Known("how long the monitor waits for the watchdog"),
    "TORCH_NCCL_HIGH_PRIORITY": Known("use high-priority CUDA streams for NCCL"),
    "TORCH_NCCL_AVOID_RECORD_STREAMS": Known("free collective inputs without recordStream"),
    "TORCH_DISTRIBUTED_DEBUG": Known(
        "c10d's debug level: OFF (default), INFO, DETAIL (adds cross-rank collective checks)",
        _debug_level,
    ),
    "TORCH_CPP_LOG_LEVEL": Known("torch's C++ log level (INFO shows c10d's own messages)"),
    "NCCL_ASYNC_ERROR_HANDLING": Known(
        "old name of TORCH_NCCL_ASYNC_ERROR_HANDLING",
        _deprecated("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    ),
    "NCCL_BLOCKING_WAIT": Known(
        "old name of TORCH_NCCL_BLOCKING_WAIT", _deprecated("TORCH_NCCL_BLOCKING_WAIT")
    ),
    "NCCL_DESYNC_DEBUG": Known(
        "old name of TORCH_NCCL_DESYNC_DEBUG", _deprecated("TORCH_NCCL_DESYNC_DEBUG")
    ),
    "NCCL_DEBUG": Known(
        "NCCL's log level: VERSION, WARN, INFO (init and topology), TRACE", _nccl_debug
    ),
    "NCCL_DEBUG_SUBSYS": Known("which NCCL subsystems log (INIT, COLL, NET, ...)"),
    "NCCL_DEBUG_FILE": Known("where NCCL writes its log (%h host, %p pid)"),
    "NCCL_SOCKET_IFNAME": Known(
        "the IP interfaces NCCL uses (prefixes; ^ excludes, = matches exactly)", _ifnames_nccl
    ),
    "NCCL_SOCKET_FAMILY": Known("AF_INET or AF_INET6 for NCCL's sockets"),
    "NCCL_IB_DISABLE": Known(
        "1: no InfiniBand/RoCE",
        _workaround("InfiniBand/RoCE off: traffic between hosts goes over TCP sockets"),
    ),
    "NCCL_P2P_DISABLE": Known(
        "1: no direct GPU-to-GPU transport (NVLink, PCIe P2P)",
        _workaround("GPU-to-GPU P2P (NVLink/PCIe) off: traffic on a host goes through host memory"),
    ),
    "NCCL_SHM_DISABLE": Known(
        "1: no shared-memory transport",
        _workaround("shared-memory transport off: ranks on a host talk over the network"),
    ),
    "NCCL_P2P_LEVEL": Known("the farthest GPU distance at which NCCL uses P2P (LOC..SYS)"),
    "NCCL_NET_GDR_LEVEL": Known("the farthest NIC-GPU distance for GPUDirect RDMA"),
    "NCCL_IB_HCA": Known("which InfiniBand adapters (and ports) NCCL uses"),
    "NCCL_IB_TIMEOUT": Known("InfiniBand verbs timeout (4.096 us * 2^value)"),
    "NCCL_IB_GID_INDEX": Known("the GID index for RoCE"),
    "NCCL_CROSS_NIC": Known("whether rings/trees may use different NICs on different hosts"),
    "NCCL_ALGO": Known("forces NCCL's algorithm (Ring, Tree, ...)", _forced),
    "NCCL_PROTO": Known("forces NCCL's protocol (LL, LL128, Simple)", _forced),
    "NCCL_BUFFSIZE": Known("bytes of NCCL's buffer per channel (default 4 MiB)"),
    "NCCL_NTHREADS": Known("CUDA threads per NCCL block"),
    "NCCL_MIN_NCHANNELS": Known("lower bound on NCCL's channels"),
    "NCCL_MAX_NCHANNELS": Known("upper bound on NCCL's channels"),
    "NCCL_NVLS_ENABLE": Known("NVLink SHARP (NVSwitch reductions) on or off"),
    "NCCL_CUMEM_ENABLE": Known("NCCL's buffers from the cuMem* API"),
    "NCCL_VERSION": Known(
        "set by NVIDIA's containers: the container's NCCL, not necessarily the one torch loaded"
    ),
    "GLOO_SOCKET_IFNAME": Known(
        "the interfaces gloo uses (exact names, comma-separated)", _ifnames_gloo
    ),
    "GLOO_DEVICE_TRANSPORT": Known("gloo's transport (TCP, TCP_TLS, UV)"),
    "TORCH_GLOO_LAZY_INIT": Known("connect gloo's pairs on first use instead of at init"),
}


def check_variables(env: Mapping[str, str]) -> tuple[list[dict[str, str]], list[Finding]]:
    """One row and one finding per relevant variable that is set."""
    rows: list[dict[str, str]] = []
    findings: list[Finding] = []
    for name, value in relevant(env).items():
        status, does, fix = judge(name, value)
        meaning = KNOWN[name].meaning if name in KNOWN else "not in the doctor's table"
        rows.append({"name": name, "value": value, "meaning": meaning, "status": status})
        detail = f": {does}" if does else f" ({meaning})"
        findings.append(Finding(f"variables.{name}", status, f"{name}={value}{detail}", fix))
    return rows, findings


def judge(name: str, value: str) -> Judgement:
    known = KNOWN.get(name)
    if known is not None:
        return known.judge(value) if known.judge else ("info", None, None)
    close = difflib.get_close_matches(name, list(KNOWN), n=1, cutoff=0.85)
    if close:
        return "warn", f"unknown; did you mean {close[0]}?", f"rename it to {close[0]}"
    return "info", None, None


def local_interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def nccl_interfaces_match(value: str, interfaces: list[str]) -> list[str]:
    """The interfaces an ``NCCL_SOCKET_IFNAME`` value selects among ``interfaces``."""
    exclude = value.startswith("^")
    patterns = [p.strip() for p in value.lstrip("^").split(",") if p.strip()]

    def hit(name: str) -> bool:
        return any(name == p[1:] if p.startswith("=") else name.startswith(p) for p in patterns)

    return [name for name in interfaces if hit(name) != exclude]
