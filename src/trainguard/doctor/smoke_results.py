"""Every rank's smoke-test outcome turned into one table and the findings that name ranks.

Every rank runs this on the same exchanged data, so every rank reaches the same verdict."""

from __future__ import annotations

from typing import Any

from trainguard.doctor.findings import Finding

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "barrier")


def smoke_section(
    backend: str, device: str, outcomes: dict[int, dict[str, Any] | None]
) -> dict[str, Any]:
    """``per_rank``: op name -> seconds (None: not run) for each rank; ``bandwidth``: rank 0's
    figures (or the first rank that has them)."""
    per_rank: dict[str, dict[str, float | None]] = {}
    bandwidth: dict[str, Any] | None = None
    for rank, outcome in sorted(outcomes.items()):
        results = outcome["results"] if outcome else []
        per_rank[str(rank)] = {r["name"]: r["seconds"] for r in results}
        for r in results:
            if r["name"] == "bandwidth" and r["ok"] and bandwidth is None:
                bandwidth = {"rank": rank, **(r["extra"] or {}), "seconds": r["seconds"]}
    return {"backend": backend, "device": device, "per_rank": per_rank, "bandwidth": bandwidth}


def smoke_findings(
    outcomes: dict[int, dict[str, Any] | None], timeout_s: float, expected_ops: list[str]
) -> list[Finding]:
    findings: list[Finding] = []
    for rank, outcome in sorted(outcomes.items()):
        findings.extend(_rank_findings(rank, outcome, timeout_s))
    if findings:
        return findings
    complete = all(
        [r["name"] for r in o["results"]] == expected_ops for o in outcomes.values() if o
    )
    if not complete:
        message = "the smoke test stopped early on some rank without an error"
        return [Finding("smoke.collectives", "fail", message)]
    slowest = max(
        r["seconds"]
        for o in outcomes.values()
        if o
        for r in o["results"]
        if r["name"] in COLLECTIVES
    )
    message = (
        f"{', '.join(COLLECTIVES)}: correct results on all {len(outcomes)} ranks "
        f"(slowest {slowest * 1000:.1f} ms)"
    )
    findings.append(Finding("smoke.collectives", "ok", message))
    bandwidth = _bandwidth_finding(outcomes)
    if bandwidth is not None:
        findings.append(bandwidth)
    return findings


def _rank_findings(rank: int, outcome: dict[str, Any] | None, timeout_s: float) -> list[Finding]:
    if outcome is None:
        message = f"rank {rank} did not report its smoke-test results within {timeout_s:g} s"
        return [Finding("smoke.report", "fail", message, "look at that rank's output", rank=rank)]
    found: list[Finding] = []
    if outcome.get("stuck_in"):
        message = f"rank {rank} was still in {outcome['stuck_in']} at the deadline"
        found.append(
            Finding(f"smoke.{outcome['stuck_in']}", "fail", message, _STUCK_FIX, rank=rank)
        )
    if outcome.get("error"):
        message = f"rank {rank}: {outcome['error']}"
        found.append(Finding("smoke.error", "fail", message, _ERROR_FIX, rank=rank))
    for result in outcome["results"]:
        if not result["ok"]:
            message = f"{result['name']} on rank {rank}: {result['detail']}"
            found.append(Finding(f"smoke.{result['name']}", "fail", message, _ERROR_FIX, rank=rank))
    return found


_STUCK_FIX = (
    "run again with NCCL_DEBUG=INFO (NCCL) or TORCH_DISTRIBUTED_DEBUG=DETAIL and look at the "
    "ranks named behind; check the network between the hosts (NCCL_SOCKET_IFNAME, firewalls)"
)
_ERROR_FIX = (
    "a wrong result or an error in a plain collective points at the transport: check the "
    "driver, NCCL_* settings and the network; rerun with NCCL_DEBUG=INFO"
)


def _bandwidth_finding(outcomes: dict[int, dict[str, Any] | None]) -> Finding | None:
    for outcome in outcomes.values():
        for r in outcome["results"] if outcome else []:
            if r["name"] == "bandwidth" and r["extra"]:
                x = r["extra"]
                message = (
                    f"all_reduce of {x['bytes'] / 2**20:.0f} MiB: median {r['seconds'] * 1000:.1f}"
                    f" ms, algbw {x['algbw_gbps']:.2f} GB/s, busbw {x['busbw_gbps']:.2f} GB/s"
                )
                return Finding("smoke.bandwidth", "info", message)
    return None
