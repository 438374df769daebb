"""Known-good checkpoints on disk: ``run_dir/checkpoints/step-{step:08d}/``.

Written at a step boundary with ``torch.distributed.checkpoint`` (model and optimizer,
sharded under FSDP2, through ``get_state_dict``) into a temporary folder, plus one small
``rank-{r}.pt`` per rank (RNG, data position, scheduler, GradScaler, the loop's own
``extra_state``, guard and recovery state); once every rank is done rank 0 writes
``manifest.json`` and renames the folder. A checkpoint is *good* once ``good_after`` healthy
steps follow it: rank 0 then writes ``GOOD`` (with the first step's loss) and deletes all
but the newest ``keep`` good ones. A bad step before that deletes it: it may hold weights
that were already drifting.

With ``async_save`` (``torch.distributed.checkpoint``; the default where the torch version
has it) the step waits only while DCP copies the state to CPU memory; the write runs in a
background thread over its own gloo process group, and the manifest and rename follow once
the checkpoint is judged (good or not), collectively, ``good_after`` steps later.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainguard.recovery.snapshot import TrainingObjects

logger = logging.getLogger(__name__)

# torch.distributed.checkpoint is imported where a checkpoint is written or read: importing
# it costs a second or more, which every guarded process (trainguard run: every launch)
# would pay at start-up, with or without checkpoints.

MANIFEST = "manifest.json"
GOOD = "GOOD"
FORMAT = 1


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step-{step:08d}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier(group: dist.ProcessGroup | None) -> None:
    if _distributed():
        dist.barrier(group=group)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def model_optimizer_state(objects: TrainingObjects) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(objects.model, objects.optimizer)
    return {"model": model, "optim": optim}


def rank_extras(objects: TrainingObjects) -> dict[str, Any]:
    out: dict[str, Any] = {"buffers": own_buffers(objects.model)}
    if objects.scheduler is not None:
        out["scheduler"] = objects.scheduler.state_dict()
    if objects.scaler is not None:
        out["scaler"] = objects.scaler.state_dict()
    if objects.extra:
        out["extra"] = objects.extra_state()
    return out


def own_buffers(model: nn.Module) -> dict[str, Tensor]:
    """This rank's plain (unsharded) buffers. The distributed checkpoint keeps one copy of a
    tensor every rank holds under the same name, whichever rank's: BatchNorm statistics,
    each rank's own under DDP, would all come back as one rank's. Each rank's file keeps its
    own, put back after the checkpoint's load (``restore_own_buffers``)."""
    return {
        name: buf.detach().to("cpu", copy=True)
        for name, buf in model.named_buffers()
        if type(buf) is Tensor
    }


def restore_own_buffers(model: nn.Module, saved: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for name, buf in model.named_buffers():
            own = saved.get(name)
            if own is not None and type(buf) is Tensor and own.shape == buf.shape:
                buf.copy_(own)


@dataclass
class Saved:
    step: int
    path: Path
    seconds: float
    """Time the step waited for the save (blocking time)."""
    future: Any = None
    """The background write of an ``async_save``; ``finish()`` waits for it."""
    group: dist.ProcessGroup | None = None
    rank: int = 0


def async_group() -> dist.ProcessGroup | None:
    """Collective: the process group the background writes use (None: not distributed)."""
    if not _distributed():
        return None
    group: dist.ProcessGroup | None = dist.new_group(backend="gloo")
    return group


def save(
    run_dir: Path,
    step: int,
    objects: TrainingObjects,
    extras: dict[str, Any],
    group: dist.ProcessGroup | None,
    rank: int,
    write_group: dist.ProcessGroup | None = None,
    use_async: bool = False,
) -> Saved:
    """Collective: every rank calls it at the same step boundary. Synchronous (finished on
    return) unless ``use_async``: then call ``finish()`` on every rank later."""
    from torch.distributed.checkpoint import state_dict_saver

    start = time.perf_counter()
    final = step_dir(run_dir, step)
    tmp = final.with_name(f".tmp-{final.name}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(group)
    torch.save({**rank_extras(objects), **extras}, tmp / f"rank-{rank}.pt")
    state = model_optimizer_state(objects)
    future = None
    dcp_async_save = getattr(state_dict_saver, "async_save", None)  # None: the save blocks
    if use_async and dcp_async_save is not None:
        future = dcp_async_save(state, checkpoint_id=str(tmp), process_group=write_group)
    else:
        state_dict_saver.save(state, checkpoint_id=str(tmp), process_group=group)
    saved = Saved(step, final, 0.0, future, group, rank)
    if future is None:
        finish(saved)
    saved.seconds = time.perf_counter() - start
    return saved


def finish(saved: Saved) -> None:
    """Collective: wait for the write, then rank 0 writes the manifest and renames."""
    if saved.future is not None:
        saved.future.result()
        saved.future = None
    group, rank, step, final = saved.group, saved.rank, saved.step, saved.path
    tmp = final.with_name(f".tmp-{final.name}")
    _barrier(group)
    if rank == 0:
        world = dist.get_world_size(group) if _distributed() else 1
        manifest = {"format": FORMAT, "step": step, "world_size": world, "time": time.time()}
        write_atomic(tmp / MANIFEST, json.dumps(manifest))
        shutil.rmtree(final, ignore_errors=True)  # a step taken again after a rollback
        os.replace(tmp, final)
    _barrier(group)


def load(path: Path, objects: TrainingObjects, rank: int) -> dict[str, Any]:
    """Collective: load ``path`` into the live objects; returns this rank's extras."""
    state = model_optimizer_state(objects)
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    dcp_load(state, checkpoint_id=str(path))
    set_state_dict(
        objects.model,
        objects.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    extras: dict[str, Any] = torch.load(path / f"rank-{rank}.pt", weights_only=False)
    restore_own_buffers(objects.model, extras.get("buffers") or {})
    if objects.scheduler is not None and "scheduler" in extras:
        objects.scheduler.load_state_dict(extras["scheduler"])
    if objects.scaler is not None and "scaler" in extras:
        objects.scaler.load_state_dict(extras["scaler"])
    missing = objects.load_extra(extras.get("extra") or {})
    if missing and rank == 0:  # every rank's file holds the same names
        logger.warning(
            "trainguard: the checkpoint %s holds no %s (Guard(extra_state=...)): left as they "
            "are (a checkpoint written before they were given to the guard)",
            path,
            ", ".join(repr(name) for name in missing),
        )
    return extras


def mark_good(run_dir: Path, step: int, first_loss: float | None, keep: int) -> None:
    """Rank 0: the checkpoint of ``step`` is good; keep the newest ``keep`` good ones."""
    path = step_dir(run_dir, step)
    if not (path / MANIFEST).exists():
        return
    write_atomic(path / GOOD, json.dumps({"first_loss": first_loss, "time": time.time()}))
    good = good_checkpoints(run_dir)
    for old in good[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    newest = step_of(good[0])
    for other in checkpoints_dir(run_dir).glob("step-*"):
        if not (other / GOOD).exists() and step_of(other) < newest:
            shutil.rmtree(other, ignore_errors=True)  # never became good


def discard(run_dir: Path, step: int) -> None:
    """Rank 0: a bad step came before the checkpoint of ``step`` became good."""
    path = step_dir(run_dir, step)
    if not (path / GOOD).exists():
        shutil.rmtree(path, ignore_errors=True)


def step_of(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def good_checkpoints(run_dir: Path) -> list[Path]:
    """Good checkpoints, newest first."""
    found = [
        path
        for path in checkpoints_dir(run_dir).glob("step-*")
        if path.is_dir() and (path / GOOD).exists() and (path / MANIFEST).exists()
    ]
    return sorted(found, key=step_of, reverse=True)


def first_loss(path: Path) -> float | None:
    try:
        value = json.loads((path / GOOD).read_text(encoding="utf-8")).get("first_loss")
    except (OSError, json.JSONDecodeError):
        return None
    return float(value) if value is not None else None


def world_size_of(path: Path) -> int | None:
    """The number of ranks that wrote the checkpoint (its manifest), None when unreadable."""
    try:
        value = json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("world_size")
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, int) else None
