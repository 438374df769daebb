"""Transient or persistent: rerun a bad step in place, agree again, watch each host's faults.

``Guard(rerun=loss_fn)``: once every rank has agreed that a step went non-finite, every rank
reruns the step from its start (``rerun.StepRerun``) and the agreement runs again. Finite
everywhere: *transient*, the step counts with the rerun's gradients; still bad: *persistent*,
the usual policy follows. Every rerun is a ``rerun`` event naming the ranks of the first
failure and the ranks and hosts it started on (``origin_ranks``: none when the gradient
all-reduce spread it to every rank, so no host is blamed for it). A host with
``suspect_host_after`` transient faults within ``suspect_host_window`` steps is *suspect*:
a ``suspect_host`` event, and every rank exits with ``EXIT_SUSPECT_HOST`` (94) so the job
restarts elsewhere.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from trainguard.config import GuardConfig
from trainguard.distributed.objects import all_gather_objects
from trainguard.events import EventLog
from trainguard.exitcodes import EXIT_SUSPECT_HOST
from trainguard.step.consensus import Consensus
from trainguard.step.detect import GradStats
from trainguard.step.evidence import StepEvidence
from trainguard.step.losses import StepLosses
from trainguard.step.rerun import StepRerun, SuspectHosts
from trainguard.step.types import Agreement, LocalReport

logger = logging.getLogger(__name__)

SUSPECT_WINDOW = 1000
"""Steps over which ``rerun.suspect_host_after`` counts a host's transient faults."""

Measure = Callable[[Tensor, int], tuple[GradStats, LocalReport, bool]]


def origin_ranks(first: Agreement, world_size: int) -> list[int]:
    """The ranks a bad step started on, as far as the agreement tells: those whose own loss
    or batch was non-finite (neither is all-reduced), else those with non-finite gradients,
    unless that is every rank of several: DDP's gradient all-reduce spreads one rank's NaN
    to all of them, so no host is to blame (none, not every one)."""
    if first.loss_ranks:
        return list(first.loss_ranks)
    if first.input_ranks:
        return list(first.input_ranks)
    if first.hyper_ranks and not first.grad_ranks:
        return list(first.hyper_ranks)
    if world_size > 1 and len(first.grad_ranks) == world_size:
        return []
    return list(first.grad_ranks)


@dataclass
class RerunParts:
    """What a rerun uses of the guard (handed over explicitly)."""

    config: GuardConfig
    consensus: Consensus
    events: EventLog
    losses: StepLosses
    measure: Measure
    """The gradient pass and this rank's report for a loss and step (``StepMeasure``)."""
    evidence: StepEvidence
    """A step's micro-batches as the guard saw them (``batches_of``)."""


class SuspectHostExit(SystemExit):
    """Every rank leaves with ``EXIT_SUSPECT_HOST``: the guard that sees it pass closes
    itself (and recovery) first (``Guard._checked``)."""


class TransientFaults:
    """Reruns agreed-bad steps and counts the transient ones per host."""

    def __init__(self, rerun: StepRerun, parts: RerunParts) -> None:
        self._rerun = rerun
        self._parts = parts
        self._hosts: list[str] | None = None
        self.verdict: str | None = None
        """The last rerun's verdict: "transient", "persistent" or None (not rerun)."""
        self.suspect_hosts = SuspectHosts(parts.config.rerun.suspect_host_after, SUSPECT_WINDOW)
        self.looked = False
        """Whether the first checked step's batches were looked for (``first_step``)."""

    def first_step(self, step: int) -> None:
        """At the first step checked: a loop whose batches the guard does not see (neither
        ``watch()`` nor ``record_batch()``) cannot be rerun; say so now, once, in one line,
        rather than at its first bad step."""
        self.looked = True
        if self._parts.consensus.rank != 0 or self._parts.evidence.batches_of(step):
            return
        logger.warning(
            "trainguard: rerun= cannot rerun this loop's steps: the guard does not see its "
            "batches; iterate guard.watch(loader), or call guard.record_batch(batch) before "
            "each forward (a bad step is skipped, not rerun, until then)"
        )

    def rerun(
        self, step: int, first: Agreement, first_stats: GradStats
    ) -> tuple[Agreement, GradStats]:
        """Every rank reruns the bad step from its start and agrees again."""
        parts = self._parts
        batches = parts.evidence.batches_of(step)
        if not batches:  # the loop neither iterates watch() nor calls record_batch()
            self.verdict = None
            self.looked = True  # said here: no second line at the step's end
            parts.events.write("rerun", step, verdict="unavailable", reason="no batches")
            logger.warning(
                "trainguard: step %d cannot be rerun: the guard has not seen its batches "
                "(iterate guard.watch(loader) or call guard.record_batch(batch))",
                step,
            )
            return first, first_stats
        recorded = len(parts.losses.step_losses())  # the loop's: check()'s, or every micro
        parts.losses.clear()
        result = self._rerun.run(step, batches)
        rerun = [*result.micro_losses, result.loss]
        parts.losses.replace(rerun[-recorded:] if recorded else rerun)  # the same basis
        stats, report, sharded = parts.measure(result.loss, step)
        agreement = parts.consensus.agree(report, sharded)
        self.verdict = "persistent" if agreement.bad else "transient"
        hosts = self._host_names()
        origin = origin_ranks(first, parts.consensus.world_size)
        bad_hosts = sorted({hosts[r] for r in origin})
        parts.events.write(
            "rerun",
            step,
            verdict=self.verdict,
            where=first.where,
            ranks=first.ranks,
            origin_ranks=origin,
            hosts=bad_hosts,
            losses=first.losses,
            rerun_losses=agreement.losses,
        )
        if parts.consensus.rank == 0:
            logger.warning(
                "trainguard: step %d non-finite %s on ranks %s, rerun in place: %s",
                step,
                first.where,
                first.ranks,
                self.verdict,
            )
        if self.verdict == "transient" and bad_hosts:
            self._count(step, bad_hosts, origin)
        return agreement, stats

    def _host_names(self) -> list[str]:
        """Every rank's host name (one gather, at the first rerun; every rank is there)."""
        if self._hosts is None:
            consensus = self._parts.consensus
            name = socket.gethostname()
            if consensus.distributed and consensus.world_size > 1:
                names = all_gather_objects(name, consensus.group, consensus.device)
                self._hosts = [str(n) for n in names]
            else:
                self._hosts = [name]
        return self._hosts

    def _count(self, step: int, hosts: list[str], ranks: list[int]) -> None:
        """A host with too many transient faults is suspect: every rank exits with 94."""
        suspect = self.suspect_hosts.transient(step, hosts)
        if not suspect:
            return
        parts = self._parts
        counts = self.suspect_hosts.counts()
        window = SUSPECT_WINDOW
        parts.events.write(
            "suspect_host",
            step,
            hosts=suspect,
            ranks=ranks,
            transient_faults={h: counts[h] for h in suspect},
            window=window,
            exit_code=EXIT_SUSPECT_HOST,
        )
        logger.error(
            "trainguard: host %s made %d transient faults within %d steps (rank %d exits "
            "with %d): drain that node and restart the job elsewhere",
            ", ".join(suspect),
            max(counts[h] for h in suspect),
            window,
            parts.consensus.rank,
            EXIT_SUSPECT_HOST,
        )
        raise SuspectHostExit(EXIT_SUSPECT_HOST)  # the guard closes, then the rank exits
