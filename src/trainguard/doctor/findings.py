"""What the doctor found: one ``Finding`` per check, and the ``DoctorReport`` that holds them.

Statuses, from harmless to fatal:

- ``ok``    the check passed.
- ``info``  worth knowing, nothing to fix (e.g. ``NCCL_DEBUG=INFO`` is set; no GPU here).
- ``warn``  the job may run but is likely to fail or crawl (``/dev/shm`` under 1 GiB, a rank
            whose ``NCCL_*`` setting differs from the others, a transport disabled).
- ``fail``  the job will not start or will hang (``MASTER_ADDR`` does not resolve, a rank
            never checked in, a collective returned a wrong result).

The exit code counts ``warn`` and ``fail`` as findings: 0 when there are none (healthy), 1
otherwise. ``info`` never changes the exit code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "info", "warn", "fail"]

EXIT_HEALTHY = 0
EXIT_FINDINGS = 1

COUNTED: frozenset[str] = frozenset({"warn", "fail"})
"""The statuses that make the doctor exit 1."""


@dataclass(frozen=True)
class Finding:
    """One check's outcome. ``check`` is ``"<section>.<name>"`` (e.g. ``"rendezvous.master_addr"``);
    ``rank`` names the rank it is about when that is not the rank printing it (None: this
    process, or the job as a whole)."""

    check: str
    status: Status
    message: str
    fix: str | None = None
    rank: int | None = None

    @property
    def section(self) -> str:
        return self.check.split(".", 1)[0]

    @property
    def counts(self) -> bool:
        return self.status in COUNTED

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(
            check=str(data["check"]),
            status=data["status"],
            message=str(data["message"]),
            fix=data.get("fix"),
            rank=data.get("rank"),
        )


@dataclass
class DoctorReport:
    """Everything one process found. Under torchrun every rank holds the same cross-rank
    findings (they are computed from data all ranks exchanged), so every rank exits alike."""

    rank: int | None
    world_size: int
    findings: list[Finding] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    rendezvous: dict[str, Any] = field(default_factory=dict)
    variables: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    smoke: dict[str, Any] | None = None
    hard_exit: bool = False
    """A collective is stuck in a thread of this process: print, then ``os._exit``."""
    full_text: bool = True
    """False on ranks other than 0 when rank 0 prints the whole job's report."""
    closer: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def close(self) -> None:
        """Call after the report is printed: under torchrun, waits (at most the timeout) until
        every rank has printed its own, so that no rank's exit cuts another's short."""
        if self.closer is not None:
            closer, self.closer = self.closer, None
            closer()

    def add(self, *findings: Finding) -> None:
        self.findings.extend(findings)

    @property
    def counted(self) -> list[Finding]:
        return [f for f in self.findings if f.counts]

    @property
    def exit_code(self) -> int:
        return EXIT_FINDINGS if self.counted else EXIT_HEALTHY

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "healthy": self.exit_code == EXIT_HEALTHY,
            "rank": self.rank,
            "world_size": self.world_size,
            "counts": {s: sum(f.status == s for f in self.findings) for s in STATUSES},
            "findings": [f.to_dict() for f in self.findings],
            "environment": self.environment,
            "rendezvous": self.rendezvous,
            "variables": self.variables,
            "ranks": self.ranks,
            "smoke": self.smoke,
        }


STATUSES: tuple[Status, ...] = ("ok", "info", "warn", "fail")
