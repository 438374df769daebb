"""Do the replicas still agree: a fingerprint of the replicated weights rides the step's
agreement every ``replica_check_every`` steps.

The fingerprint is exact and cheap: per parameter one number (``param_sum``, on the device,
no host sync), the numbers weighted by a fixed per-parameter factor (so changes in two
parameters cannot cancel) and added. Healthy replicas hold bit-identical weights, so their
fingerprints are bit-identical; a change of one element by 1e-3, a NaN or an Inf changes it.
Blind spots: values permuted inside one parameter, or changes that cancel exactly inside
one. It is taken in ``check()``, after backward and before the optimizer step: the weights
after the previous update.

On a disagreement (every rank sees the same fingerprints, so every rank takes the same
path): the majority rule names the ranks that differ, one gather of the per-parameter sums
names the parameters, a ``replica_divergence`` event is written on every rank, and
``on_divergence`` acts: ``warn``, ``resync`` (``resync.py``: broadcast from a majority rank)
or ``raise`` (``ReplicaDivergenceError``). Never for FSDP2 (DTensor shards differ by design).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainguard.config import HealthConfig
from trainguard.errors import ReplicaDivergenceError
from trainguard.events import EventLog
from trainguard.health.resync import broadcast_state, ddp_inner, user_module

logger = logging.getLogger(__name__)

MAX_NAMED = 32
"""At most this many differing parameters are named in an event (all are counted)."""
_CHUNK = 1 << 24
"""Elements summed per kernel: caps the float64 copy a large parameter's sum makes."""
BIT_SUM_MIN = 1 << 16
"""A CPU parameter of at least this many 4- or 2-byte floats is summed by its bit patterns
(``param_sum``): the float64 sum costs some 2-3 ns an element there (50-76 ms a check of a
25M-parameter MLP under 2-rank DDP), the bit sum and the finiteness sum 11-17 ms
(docs/benchmarks.md). Smaller ones, and every parameter on other devices (one memory-bound
pass, one kernel), sum their values."""
_WORD = {4: torch.int32, 2: torch.int16}
_GOLDEN = 0.6180339887498949


@dataclass(frozen=True)
class Verdict:
    """Who disagrees, by the majority rule over the ranks' fingerprints."""

    reference: int
    """A rank of the majority (the lowest): the copy a resync takes."""
    ranks: list[int]
    """Ranks that differ from the majority; every rank on a tie."""
    tie: bool
    """No strict majority: the largest groups of equal fingerprints are as large."""


def _key(value: float) -> float | str:
    return value if math.isfinite(value) else "nonfinite"


def agree(fingerprints: list[float]) -> bool:
    """Every rank's fingerprint is the same (non-finite ones count as equal)."""
    return len({_key(v) for v in fingerprints}) <= 1


def majority(fingerprints: list[float]) -> Verdict:
    """The majority rule: ranks grouped by equal fingerprint; the largest finite group is
    the majority (the one holding the lowest rank among equals); a non-finite fingerprint
    is never the majority while a finite one exists."""
    groups: dict[float | str, list[int]] = {}
    for rank, value in enumerate(fingerprints):
        groups.setdefault(_key(value), []).append(rank)
    finite = [members for key, members in groups.items() if key != "nonfinite"]
    candidates = finite or list(groups.values())
    best = max(candidates, key=lambda members: (len(members), -members[0]))
    tie = sum(len(members) == len(best) for members in candidates) > 1
    everyone = range(len(fingerprints))
    ranks = list(everyone) if tie else [r for r in everyone if r not in best]
    return Verdict(reference=best[0], ranks=ranks, tie=tie)


def param_sum(param: Tensor) -> Tensor:
    """A parameter's summary, float64, 0-d, on its device, no sync; NaN when an element is NaN
    or infinite. Equal parameters give equal numbers, on every rank the same way:

    - a large float32, float16 or bfloat16 parameter on the CPU (``BIT_SUM_MIN``): the sum of
      its elements' bit patterns as integers, wrapped modulo 2**32 (integer addition, so the
      same in any order: thread counts and kernels cannot make equal replicas differ; any
      change of one element changes it, down to one ulp), plus 0 or NaN from the float32 sum
      of its values (NaN or Inf when an element is);
    - any other: the float64 sum of its values (one pass; a change of one element shows when
      it exceeds the sum's float64 rounding, 1e-3 always on weights of usual sizes)."""
    flat = param.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1)
    word = _WORD.get(flat.element_size()) if flat.is_floating_point() else None
    if word is not None and flat.is_cpu and flat.numel() >= BIT_SUM_MIN:
        bits = torch.sum(flat.view(word), dtype=torch.int32).double()
        total = torch.sum(flat, dtype=torch.float32)  # finite - itself is 0, else NaN
        return bits.add_(total.sub_(total))
    if flat.numel() <= _CHUNK:
        return torch.sum(flat, dtype=torch.float64)
    return torch.stack([torch.sum(c, dtype=torch.float64) for c in torch.split(flat, _CHUNK)]).sum()


def factors(count: int) -> Tensor:
    """Fixed per-parameter weights in [1, 2): the i-th is ``1 + frac(i * golden ratio)``."""
    return torch.tensor([1.0 + (i * _GOLDEN) % 1.0 for i in range(count)], dtype=torch.float64)


def replicated_params(model: nn.Module) -> list[tuple[str, Tensor]]:
    """The parameters every replica holds, by the user's names: none for FSDP2 (DTensor
    shards). Where the model holds DDP modules without being one (timm's training task: the
    DDP-wrapped network beside an EMA copy made on each rank before the wrap), the
    parameters inside them: DDP makes those equal at its construction and keeps them so, the
    rest were never made equal. DDP's ``_ddp_params_and_buffers_to_ignore`` are left out."""
    inner = user_module(model)
    params = list(inner.named_parameters())
    if any(hasattr(p, "to_local") for _, p in params):
        return []
    wrapped = [ddp for m in inner.modules() if (ddp := ddp_inner(m)) is not None]
    if not wrapped:
        return [(name, p) for name, p in params if name not in _ignored(inner)]
    kept = {
        id(p)
        for module in wrapped
        for name, p in module.named_parameters()
        if name not in _ignored(module)
    }
    return [(name, p) for name, p in params if id(p) in kept]


def _ignored(module: nn.Module) -> set[str]:
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


class ReplicaWatch:
    """Fingerprints the replicated weights when due; acts on a disagreement."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: HealthConfig,
        events: EventLog,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._config = config
        self._events = events
        self._rank = rank
        self._world_size = world_size
        self._group = group
        self._params: list[tuple[str, Tensor]] | None = None  # taken at the first check
        self._factors: Tensor | None = None
        self._zero: Tensor | None = None
        self._device = torch.device("cpu")
        self._sums: dict[int, Tensor] = {}
        """Per-parameter sums of the checked steps not yet observed (the sync-free step
        reads its agreement a step late)."""
        self.on_resync: Callable[[int, int], None] | None = None
        """Called after a resync with its step and reference rank (recovery: a rollback to a
        snapshot from before it resyncs again from that rank)."""
        self.checks = 0
        """Checks observed (steps whose fingerprints were compared)."""
        self.diverged_at: int | None = None
        """The first step at which the replicas were seen to differ (None: never)."""
        self.divergence: dict[str, Any] | None = None
        """The fields of the latest ``replica_divergence`` event (with its ``step``)."""
        self.divergences = 0
        """Checks that found the replicas differing (``replica_divergence`` events)."""
        self.no_replicas = False
        """No DDP holds the model and the ranks were apart at the first check, or drifted
        apart by the second: never replicas, checked no more (``on_divergence="warn"``;
        ``_never_replicas``)."""
        self._told: tuple[int, ...] | None = None
        """The ranks of the divergence last warned about: while the same ranks stay apart
        (nothing repairs it under ``warn``) later checks write their events and say nothing;
        a check that finds the replicas equal again clears it."""

    # -- the fingerprint (every rank, each due step) -----------------------------------------

    def due(self, step: int) -> bool:
        """Whether ``step`` is checked: the same answer on every rank."""
        every = self._config.replica_check_every
        if every <= 0 or self._world_size < 2 or step % every != 0 or self.no_replicas:
            return False
        return bool(self._replicated())

    def _replicated(self) -> list[tuple[str, Tensor]]:
        if self._params is None:
            self._params = replicated_params(self._model)
        return self._params

    def fingerprint(self, step: int, device: torch.device) -> Tensor:
        """A float64 0-d tensor on ``device``: the fingerprint when due at ``step``, else 0."""
        self._device = device
        if not self.due(step):
            if self._zero is None or self._zero.device != device:
                self._zero = torch.zeros((), dtype=torch.float64, device=device)
            return self._zero
        sums = self.param_sums(device)
        self._sums[step] = sums
        for old in [s for s in self._sums if s < step - 1]:
            del self._sums[old]
        return (sums * self._factors_on(device)).sum()

    def param_sums(self, device: torch.device) -> Tensor:
        """float64 ``[n_params]`` on ``device``: each replicated parameter's ``param_sum``."""
        return torch.stack([param_sum(p).to(device) for _, p in self._replicated()])

    def _factors_on(self, device: torch.device) -> Tensor:
        if self._factors is None or self._factors.device != device:
            self._factors = factors(len(self._replicated())).to(device)
        return self._factors

    # -- the agreed fingerprints (every rank, the same lists) --------------------------------

    def observe(self, step: int, fingerprints: list[float]) -> None:
        """The agreed fingerprints of ``step`` (identical on every rank): on a disagreement,
        an event and ``on_divergence`` (warn, resync by broadcast, raise) on every rank."""
        sums = self._sums.pop(step, None)
        if not self.due(step) or len(fingerprints) < 2:
            return
        self.checks += 1
        if agree(fingerprints):
            self._told = None
            return
        verdict = majority(fingerprints)
        differing = self._differing_params(sums, verdict.reference)
        action = self._config.on_divergence
        self.no_replicas = self._never_replicas(action)
        self._report(step, verdict, differing, fingerprints)
        if action == "resync":
            self.resync_from(verdict.reference)
            if self.on_resync is not None:
                self.on_resync(step, verdict.reference)
        elif action == "raise":
            raise self._error(step, verdict, differing)

    def _never_replicas(self, action: str) -> bool:
        """A divergence of a model no DDP holds (the same answer on every rank) at the guard's
        first check, or at its second when the first found the ranks equal: a script that
        trains a model of its own on each rank, from its own seed (apart at once) or from the
        same seed (apart after the first updates, as PyTorch's ImageNet example on CPU with
        ``--seed``). Nothing makes them equal, so checking again would only repeat it."""
        if action != "warn" or self.checks > 2 or self.divergences:
            return False
        return not any(ddp_inner(module) is not None for module in self._model.modules())

    def _differing_params(self, sums: Tensor | None, reference: int) -> list[str] | None:
        """The parameters whose sums differ from the reference rank's (a collective every
        rank takes); None when the ranks hold different parameter lists."""
        if sums is None:  # not kept: the current weights (still differ unless repaired)
            sums = self.param_sums(self._device)
        counts = self._all_gather(torch.tensor([float(sums.numel())], device=self._device))
        if len({float(c.item()) for c in counts}) > 1:
            return None
        table = torch.stack(self._all_gather(sums)).cpu()
        ref = table[reference]
        same = (table == ref) | (table.isnan() & ref.isnan())
        names = [name for name, _ in self._replicated()]
        return [names[i] for i in (~same.all(0)).nonzero().flatten().tolist()]

    def _all_gather(self, tensor: Tensor) -> list[Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor, group=self._group)
        return parts

    def _report(
        self, step: int, verdict: Verdict, params: list[str] | None, fingerprints: list[float]
    ) -> None:
        action = self._config.on_divergence
        found = params or []
        fields: dict[str, Any] = {
            "ranks": verdict.ranks,
            "params": found[:MAX_NAMED],
            "params_differing": len(found) if params is not None else None,
            "majority_rank": verdict.reference,
            "tie": verdict.tie,
            "action": action,
            "fingerprints": fingerprints,
            "no_replicas": self.no_replicas,
        }
        self._events.write("replica_divergence", step, **fields)
        self.divergences += 1
        if self.diverged_at is None:
            self.diverged_at = step
        self.divergence = {"step": step, **fields}
        told, self._told = self._told, tuple(verdict.ranks)
        log = logger.warning if self._rank == 0 and told != self._told else logger.debug
        log("trainguard: %s", self._describe(step, verdict, params))

    def _describe(self, step: int, verdict: Verdict, params: list[str] | None) -> str:
        if verdict.tie:
            who = f"ranks {verdict.ranks} disagree with no majority (a tie)"
        else:
            who = f"rank(s) {verdict.ranks} differ from the majority (rank {verdict.reference})"
        if params is None:
            what = "the ranks hold different parameter lists (not replicas?)"
        else:
            shown = ", ".join(params[:MAX_NAMED]) + (" ..." if len(params) > MAX_NAMED else "")
            what = f"{len(params)} parameter(s) differ: {shown or '(none now)'}"
        first = " at the first check" if self.checks == 1 else ""
        action = self._config.on_divergence
        outcome = {
            "warn": "going on (on_divergence='warn'; later checks that find the same ranks "
            "apart write their events and say nothing)",
            "resync": f"every rank takes rank {verdict.reference}'s weights, buffers and "
            "optimizer state (on_divergence='resync')",
            "raise": "stopping (on_divergence='raise')",
        }[action]
        hint = (
            "; if this model is not replicated across ranks (pipeline or tensor parallel), "
            "set replica_check_every=0 (trainguard run: -o replica_check_every=0)"
            if first
            else ""
        )
        if self.no_replicas:
            why = (
                "so the ranks were never made equal"
                if first
                else "and the ranks, equal at the first check, drifted apart with their "
                "updates: nothing averages their gradients, each trains a copy of its own"
            )
            outcome = (
                f"no DDP holds this model, {why}: taken for no replicas, not checked again "
                "(if they should be replicas, wrap the model in DistributedDataParallel, "
                "or broadcast the initial weights from one rank and average the gradients)"
            )
            hint = ""
        return f"step {step}: replicas diverged{first}: {who}; {what}; {outcome}{hint}"

    def resync_from(self, reference: int) -> None:
        """Every rank takes rank ``reference``'s (of the group) weights, buffers and optimizer
        state. Collective."""
        src = reference if self._group is None else dist.get_global_rank(self._group, reference)
        broadcast_state(self._model, self._optimizer, src, self._group, self._device)

    def _error(
        self, step: int, verdict: Verdict, params: list[str] | None
    ) -> ReplicaDivergenceError:
        message = (
            f"{self._describe(step, verdict, params)}. Use on_divergence='resync' to take the "
            "majority's weights and go on, or 'warn'; look for what made the rank drift (a "
            "rank that skipped or repeated an update, a non-deterministic op, bad memory)"
        )
        return ReplicaDivergenceError(message, step=step, ranks=verdict.ranks, params=params or [])
