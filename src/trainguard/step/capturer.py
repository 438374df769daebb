"""Writing a capture bundle on a bad step, from every rank, atomically (format: bundle.py).

Every rank reaches the same decision on a bad step, so the capture may use collectives:

1. the ranks agree on a temporary folder ``captures/.tmp-step-{step:08d}-{token}``;
2. each rank writes ``rank-{r}/`` into it (FSDP2: plus its shard under ``dcp/`` with
   torch.distributed.checkpoint, a collective that reports any rank's failure to all);
3. the ranks gather their file checksums (or their errors) on rank 0, which writes
   ``manifest.json`` last and renames the folder to ``step-{step:08d}``;
4. rank 0's outcome is shared, so every rank returns the same path (or None).

"First" is per run (``trainguard.runs.identity``): the manifest records the run's id, and a
torchrun restart or a resume of a run whose first bad step (or spike) is already captured
labels its own first one ``first_bad_step_after_restart`` (``first_spike_after_restart``).

A failure to write (disk full, permission, a rank that cannot see the shared run_dir) is
caught on every rank: the temporary folder is removed, a ``capture_failed`` event and a log
line say why, and the run goes on as the policy says. ``run_dir`` must be a folder all ranks
see (a shared filesystem on multi-node runs), as for torch.distributed.checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import secrets
import shutil
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainguard.capture import batchcodec
from trainguard.capture.bundle import (
    DCP_DIR,
    FORMAT,
    HISTORY,
    MANIFEST,
    TMP_PREFIX,
    VERSION,
    FileRecord,
    checksum_file,
    encode_rng,
    sync_in_background,
    write_json,
    write_torch,
)
from trainguard.capture.optim_state import optimizer_state
from trainguard.distributed.objects import all_gather_objects
from trainguard.events import EventLog
from trainguard.step.bad_step import BadStep, rank_meta
from trainguard.step.consensus import Consensus
from trainguard.step.types import Decision

logger = logging.getLogger(__name__)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers (state dict keys without prefix)."""
    inner = model
    while type(inner).__name__ in ("DistributedDataParallel", "OptimizedModule"):
        attr = "module" if type(inner).__name__ == "DistributedDataParallel" else "_orig_mod"
        wrapped = getattr(inner, attr, None)
        if not isinstance(wrapped, nn.Module):
            break
        inner = wrapped
    return inner


def is_sharded_model(model: nn.Module) -> bool:
    """Parameters are DTensors (FSDP2 ``fully_shard``): weights are saved with DCP."""
    return any(hasattr(p, "to_local") for p in model.parameters())


class Capturer:
    """Writes bundles for one Guard: on the first bad step, and again on escalation."""

    def __init__(self, run_dir: Path, consensus: Consensus, events: EventLog) -> None:
        self.folder = Path(run_dir) / "captures"
        self._consensus = consensus
        self._events = events
        self._first_done = {"nonfinite": False, "spike": False}
        """Whether the first non-finite step and the first spike were captured (each once)."""
        self.bundles: list[Path] = []
        self.syncing: threading.Thread | None = None
        """The background flush to disk of the last bundle (``bundle.sync_in_background``)."""

    @property
    def rank(self) -> int:
        return self._consensus.rank

    def due(self, decision: Decision, spike: bool = False) -> bool:
        """Capture this bad step? The run's first non-finite step, its first spike (``spike``:
        a spike, not a non-finite step; each captured once, independently), every escalation."""
        if decision in (Decision.OK, Decision.OVERFLOW):
            return False
        return decision is Decision.ESCALATE or not self._first_done[_kind(spike)]

    def capture(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        evidence: BadStep,
        spike: bool = False,
    ) -> Path | None:
        """Write the bundle on every rank (collective); the same path or None on every rank."""
        self._first_done[_kind(spike)] = True
        evidence.spike = spike
        if spike and evidence.reason == "first_bad_step":
            evidence.reason = "first_spike"
        start = time.monotonic()
        try:
            path, error = self._capture(model, optimizer, evidence)
        except Exception as exc:  # a failed collective: never take the run down here
            path, error = None, f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - start
        if path is not None:
            self.bundles.append(path)
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            self._events.write(
                "capture",
                evidence.step,
                path=path,
                reason=evidence.reason,
                bytes=size,
                seconds=round(seconds, 3),
            )
            if self.rank == 0:
                logger.warning(
                    "trainguard: step %d captured to %s (%.1f MB in %.2fs); replay it with "
                    "`trainguard replay %s --factory MODULE:FUNC`",
                    evidence.step,
                    path,
                    size / 1e6,
                    seconds,
                    path,
                )
            return path
        self._events.write("capture_failed", evidence.step, error=error, reason=evidence.reason)
        logger.error(
            "trainguard: rank %d: step %d could not be captured under %s: %s; training goes "
            "on as the policy says",
            self.rank,
            evidence.step,
            self.folder,
            error,
        )
        return None

    # -- the collective write ------------------------------------------------------------

    def _gather(self, obj: Any) -> list[Any]:
        consensus = self._consensus
        if not consensus.distributed or consensus.world_size == 1:
            return [obj]
        return all_gather_objects(obj, consensus.group, consensus.device)

    def _capture(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, evidence: BadStep
    ) -> tuple[Path | None, str | None]:
        # rank 0's token and label (the run's earlier bundles are looked up there only)
        token, evidence.reason = self._gather((secrets.token_hex(4), self._label(evidence)))[0]
        tmp = self.folder / f"{TMP_PREFIX}step-{evidence.step:08d}-{token}"
        sharded = is_sharded_model(model)
        records: dict[str, FileRecord] = {}
        error: str | None = None
        try:
            records = write_rank(tmp, self.rank, model, optimizer, evidence, sharded)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if sharded:  # every rank joins the DCP collective, even after a local failure
            try:
                records.update(self._save_shards(tmp, model, optimizer))
            except Exception as exc:
                error = error or f"torch.distributed.checkpoint: {type(exc).__name__}: {exc}"
        results = self._gather((self.rank, records, error))
        outcome: tuple[str | None, str | None] = (None, None)
        if self.rank == 0:
            outcome = self._publish(tmp, evidence, sharded, results)
        path, failure = self._gather(outcome)[0]
        return (Path(path) if path else None), failure

    def _save_shards(
        self, tmp: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, FileRecord]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        from torch.distributed.checkpoint.state_dict_saver import save

        state = {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer),
        }
        folder = tmp / DCP_DIR
        save(state, checkpoint_id=str(folder), process_group=self._consensus.group)
        if self.rank != 0:
            return {}
        return {
            f"{DCP_DIR}/{p.name}": checksum_file(p) for p in sorted(folder.iterdir()) if p.is_file()
        }

    def _publish(
        self,
        tmp: Path,
        evidence: BadStep,
        sharded: bool,
        results: list[tuple[int, dict[str, FileRecord], str | None]],
    ) -> tuple[str | None, str | None]:
        errors = [f"rank {rank}: {error}" for rank, _, error in results if error]
        files = {name: rec for _, recs, _ in results for name, rec in recs.items()}
        unseen = sorted(name for name in files if not (tmp / name).is_file())
        if unseen and not errors:
            errors.append(
                f"rank 0 cannot see {unseen[0]}: run_dir must be on a filesystem every rank shares"
            )
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
            return None, "; ".join(errors)
        try:
            if evidence.history is not None:  # the same on every rank: rank 0 writes it
                files[HISTORY] = write_json(tmp / HISTORY, evidence.history)
            manifest = build_manifest(evidence, sharded, self._consensus.world_size, files)
            if self._events.run is not None:
                manifest["run"] = self._events.run.id
            write_json(tmp / MANIFEST, manifest)
            final = self._final_path(evidence.step)
            os.rename(tmp, final)
            self.syncing = sync_in_background(final)  # off the step; checksums guard reads
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            return None, f"rank 0: {type(exc).__name__}: {exc}"
        return str(final), None

    def _label(self, evidence: BadStep) -> str:
        """The bundle's reason: a first bad step (spike) is the run's first only once, even
        across torchrun restarts and resumes of the run (rank 0 looks at its bundles)."""
        run = self._events.run
        reason = evidence.reason
        if self.rank != 0 or run is None or run.origin == "new" or reason not in _FIRSTS:
            return reason
        for manifest in sorted(self.folder.glob(f"step-*/{MANIFEST}")):
            try:
                found = json.loads(manifest.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(found, dict) and (found.get("run"), found.get("reason")) == (
                run.id,
                reason,
            ):
                return f"{reason}{AFTER_RESTART}"
        return reason

    def _final_path(self, step: int) -> Path:
        final = self.folder / f"step-{step:08d}"
        n = 1
        while final.exists():  # a resumed run that fails at the same step keeps both bundles
            final = self.folder / f"step-{step:08d}.{n}"
            n += 1
        return final


_FIRSTS = ("first_bad_step", "first_spike")
AFTER_RESTART = "_after_restart"
"""Suffix of a first bad step's (spike's) reason when the run already captured its first."""


def _kind(spike: bool) -> str:
    return "spike" if spike else "nonfinite"


def build_manifest(
    evidence: BadStep, sharded: bool, world_size: int, files: dict[str, FileRecord]
) -> dict[str, Any]:
    agreement = evidence.agreement
    now = datetime.now(timezone.utc)
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": evidence.step,
        "world_size": world_size,
        "saved_ranks": list(range(world_size)),
        "trigger": "spike" if evidence.spike else agreement.where,
        "ranks": agreement.ranks,
        "loss_ranks": agreement.loss_ranks,
        "grad_ranks": agreement.grad_ranks,
        "losses": agreement.losses,
        "grad_norm": agreement.grad_norm,
        "decision": evidence.decision.value,
        "reason": evidence.reason,
        "sharded": sharded,
        "time": now.timestamp(),
        "time_utc": now.isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "trainguard": _version(),
        "files": {name: r.to_manifest() for name, r in sorted(files.items())},
        **({"factory_config": evidence.factory_config} if evidence.factory_config else {}),
    }


def _version() -> str:
    module = sys.modules.get("trainguard")  # not imported at the top: trainguard imports us
    return str(getattr(module, "__version__", "unknown"))


def write_rank(
    tmp: Path,
    rank: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    evidence: BadStep,
    sharded: bool,
) -> dict[str, FileRecord]:
    """Write ``rank-{rank}/`` under ``tmp``; returns checksums keyed by bundle-relative path."""
    folder = tmp / f"rank-{rank}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    inner = unwrap(model)
    micro = evidence.micro_batches
    files: dict[str, Any] = {
        "batch.pt": {"micro_batches": [batchcodec.encode(b) for b in micro or []]},
        "rng.pt": encode_rng(evidence.rng) if evidence.rng is not None else {},
    }
    if not sharded:
        state = inner.state_dict()
        state.update((k, v) for k, v in evidence.buffers.items() if k in state)
        files["model.pt"] = {k: v.detach().cpu() for k, v in state.items()}
        files["optimizer.pt"] = optimizer_state(optimizer)  # a ZeRO optimizer: this rank's shard
    records = {
        f"rank-{rank}/{name}": write_torch(folder / name, obj) for name, obj in files.items()
    }
    meta = rank_meta(rank, inner, evidence)
    records[f"rank-{rank}/meta.json"] = write_json(folder / "meta.json", meta)
    return records
