"""Every rank's versions and variables side by side: the ranks that differ are named.

The reference value is the one most ranks have (rank 0's on a tie); the other ranks are the
odd ones. Version differences: torch, CUDA or NCCL ``fail`` (mixed builds hang or crash in the
first collective), Python ``warn`` (pickled objects in object collectives), the driver
``info`` (hosts may differ; the CUDA build must be supported by each). A relevant variable
(``NCCL_*``, ``TORCH_NCCL_*``, ``GLOO_*``, ``TORCH_DISTRIBUTED_DEBUG``, ...) that is not the
same on every rank is ``warn``: NCCL and torch read them per process, so ranks end up
configured differently (a different ``NCCL_SOCKET_IFNAME``, ``NCCL_ALGO`` or
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` on one rank is a classic source of hangs).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from trainguard.doctor.findings import Finding, Status

VERSION_STATUS: dict[str, Status] = {
    "torch": "fail",
    "cuda": "fail",
    "nccl": "fail",
    "python": "warn",
    "driver": "info",
}
SAME_ENV_FIX = (
    "set it the same way for every rank: in the launch command or job script, not in a "
    "per-host profile"
)


def odd_ranks(values: dict[int, Any]) -> tuple[Any, list[int]]:
    """The reference value and the ranks whose value differs from it."""
    counts = Counter(_key(v) for v in values.values())
    top = max(counts.values())
    first = min(values)
    reference_key = _key(values[first])
    if counts[reference_key] != top:
        reference_key = next(k for k, c in counts.items() if c == top)
    reference = next(v for v in values.values() if _key(v) == reference_key)
    return reference, sorted(r for r, v in values.items() if _key(v) != reference_key)


def _key(value: Any) -> str:
    return repr(value)


def compare_ranks(payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    """Findings for every version and variable that is not the same on every rank."""
    findings: list[Finding] = []
    for name, status in VERSION_STATUS.items():
        values = {r: p["versions"].get(name) for r, p in payloads.items()}
        finding = _difference(f"ranks.{name}", name, values, status, _version_fix(name))
        if finding is not None:
            findings.append(finding)
    names = sorted({n for p in payloads.values() for n in p["variables"]})
    for name in names:
        values = {r: p["variables"].get(name) for r, p in payloads.items()}
        finding = _difference(f"ranks.{name}", name, values, "warn", SAME_ENV_FIX)
        if finding is not None:
            findings.append(finding)
    if not findings:
        message = (
            f"all {len(payloads)} ranks have the same torch, CUDA, NCCL and Python, and the "
            f"same {len(names)} NCCL/gloo/c10d variable(s)"
        )
        findings.append(Finding("ranks.match", "ok", message))
    return findings


def _difference(
    check: str, name: str, values: dict[int, Any], status: Status, fix: str
) -> Finding | None:
    reference, odd = odd_ranks(values)
    if not odd:
        return None
    by_value: dict[str, list[int]] = {}
    for r in odd:
        by_value.setdefault(_shown(values[r]), []).append(r)
    parts = [f"{_ranks(rs)} {_has(rs)} {v}" for v, rs in by_value.items()]
    others = sorted(r for r in values if r not in odd)
    message = (
        f"{name} differs: {'; '.join(parts)}; {_ranks(others)} {_has(others)} {_shown(reference)}"
    )
    return Finding(check, status, message, fix, rank=odd[0] if len(odd) == 1 else None)


def _version_fix(name: str) -> str:
    if name == "driver":
        return "make sure every host's driver supports the CUDA version of torch"
    return f"install the same {name} on every host (one container image or environment)"


def _shown(value: Any) -> str:
    return "it unset" if value is None else repr(value)


def _has(ranks: list[int]) -> str:
    return "has" if len(ranks) == 1 else "have"


def _ranks(ranks: list[int]) -> str:
    joined = ", ".join(str(r) for r in ranks)
    return f"rank {joined}" if len(ranks) == 1 else f"ranks {joined}"
