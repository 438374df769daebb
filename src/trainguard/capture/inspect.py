"""What a bundle holds, without replaying it: ``trainguard inspect BUNDLE [--json]``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainguard.capture import batchcodec, batchtree
from trainguard.capture.bundle import Bundle, load_bundle
from trainguard.errors import BundleError

MAX_PARAMS = 20


def inspect_bundle(path: Path | str | Bundle) -> dict[str, Any]:
    """A JSON-ready summary: what happened, where, which ranks, per-rank loss, bad
    parameters, the batch's structure with shapes, dtypes and value statistics, and sizes."""
    bundle = path if isinstance(path, Bundle) else load_bundle(path)
    manifest = bundle.manifest
    files = bundle.files
    return {
        "bundle": str(bundle.path),
        "format": f"{manifest['format']} v{manifest['version']}",
        "step": bundle.step,
        "trigger": bundle.trigger,
        "ranks": bundle.ranks,
        "loss_ranks": manifest.get("loss_ranks", []),
        "grad_ranks": manifest.get("grad_ranks", []),
        "world_size": bundle.world_size,
        "decision": manifest.get("decision"),
        "reason": manifest.get("reason"),
        "time_utc": manifest.get("time_utc"),
        "torch": manifest.get("torch"),
        "python": manifest.get("python"),
        "sharded": bundle.sharded,
        "grad_norm": manifest.get("grad_norm"),
        "losses": manifest.get("losses"),
        "bytes": sum(int(rec.get("bytes", 0)) for rec in files.values()),
        "weights_identical_across_ranks": _weights_identical(bundle),
        "history": history_summary(bundle.history),
        "per_rank": [_rank_summary(bundle, rank) for rank in bundle.saved_ranks],
    }


def _weights_identical(bundle: Bundle) -> bool | None:
    """Replicated (DDP) runs: are the ranks' parameters the same? Equal checksums of the
    weight files answer at once; otherwise the parameters (the names with gradients in
    ``meta.json``) are compared, since buffers such as BatchNorm statistics are each rank's
    own under DDP and differ by design."""
    if bundle.sharded or bundle.world_size < 2:
        return None
    files = bundle.files
    sums = {str(files.get(f"rank-{r}/model.pt")) for r in bundle.saved_ranks}  # crc32 + bytes
    if len(sums) == 1:
        return True
    names: set[str] = set()
    for rank in bundle.saved_ranks:
        names.update((bundle.meta(rank).get("param_grad_norms") or {}).keys())
    if not names:
        return False
    states = [bundle.model_state(r) for r in bundle.saved_ranks]
    first = states[0]
    return all(
        name in state and name in first and torch.equal(state[name], first[name])
        for state in states[1:]
        for name in names
    )


def _rank_summary(bundle: Bundle, rank: int) -> dict[str, Any]:
    meta = bundle.meta(rank)
    env = meta.get("env") or {}
    prefix = f"rank-{rank}/"
    sizes = {
        name.removeprefix(prefix): int(rec.get("bytes", 0))
        for name, rec in bundle.files.items()
        if name.startswith(prefix)
    }
    bad = list(meta.get("nonfinite_params") or [])
    summary: dict[str, Any] = {
        "rank": rank,
        "saw_it": rank in bundle.ranks,
        "host": env.get("host"),
        "device": env.get("device"),
        "loss": meta.get("loss"),
        "micro_losses": meta.get("micro_losses"),
        "local_grad_norm": meta.get("local_grad_norm"),
        "nonfinite_params": bad[:MAX_PARAMS],
        "nonfinite_params_total": len(bad),
        "dataset_indices": meta.get("dataset_indices"),
        "files": sizes,
        "batch": None,
    }
    if meta.get("batch_stored", True):
        summary["batch"] = [_describe(b, stored) for b, stored in _stored_batches(bundle, rank)]
    return summary


def _stored_batches(bundle: Bundle, rank: int) -> list[tuple[Any, str | None]]:
    """Each micro-batch, decoded without importing the script's types (a dataclass comes
    back as a dict), with the type the capture recorded for it (``module:qualname`` of a
    dataclass, namedtuple or dict subclass; None for anything else)."""
    path = bundle.rank_dir(rank) / "batch.pt"
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise BundleError(path, f"cannot load ({type(exc).__name__}: {exc})") from exc
    micro = stored.get("micro_batches") if isinstance(stored, dict) else None
    if not isinstance(micro, list):
        raise BundleError(path, "holds no micro_batches list")
    return [(batchcodec.decode(item, restore_types=False), _type_tag(item)) for item in micro]


def _type_tag(item: Any) -> str | None:
    tag = item.get("type") if isinstance(item, dict) and batchcodec.TAG in item else None
    return tag if isinstance(tag, str) and tag else None


def _describe(batch: Any, stored_type: str | None = None) -> dict[str, Any]:
    """A micro-batch's type (the one it was captured as: ``Batch`` for a dataclass
    ``__main__:Batch``, not the dict it is read back as), size and leaves."""
    leaves = [
        {"path": path or "(batch)", **batchtree.describe_leaf(leaf)}
        for path, leaf in batchtree.leaves(batch)
    ]
    name = stored_type.rpartition(":")[2] if stored_type else type(batch).__name__
    return {
        "type": name,
        "stored_type": stored_type,
        "batch_size": batchtree.batch_size(batch),
        "leaves": leaves,
    }


def history_summary(records: list[dict[str, Any]] | None, last: int = 5) -> dict[str, Any] | None:
    """The bundle's recent-steps history in short: how many steps, the decisions, the first
    and last loss and gradient norm, and the last few records (None: no history)."""
    if records is None:
        return None
    decisions: dict[str, int] = {}
    for record in records:
        key = str(record.get("decision"))
        decisions[key] = decisions.get(key, 0) + 1
    first, final = (records[0], records[-1]) if records else ({}, {})
    return {
        "steps": len(records),
        "first_step": first.get("step"),
        "last_step": final.get("step"),
        "decisions": decisions,
        "first": {"losses": first.get("losses"), "grad_norm": first.get("grad_norm")},
        "last_records": records[-last:],
    }
