"""The stop record: ``run_dir/stop.json``, written when the guard gives up.

The guard's final stop (an escalation it does not roll back: the ladder exhausted after
``max_rollbacks``, or ``on_escalation="raise"``; non-finite steps, spikes or a collapsed fp16
loss scale) leaves one small JSON, written by rank 0 atomically: the step, the cause, the
capture bundle, the checkpoint a restart would resume from, and a fingerprint of what a
restart would run with. ``restart.py`` compares a restarted attempt with it and refuses to
run into the same failure again. ``on_nonfinite="raise"`` (the first bad step stops the run,
by choice) is not such a stop and writes nothing.

The fingerprint hashes (``inputs``, kept in the record so a person can see what counted):

- ``config``: every ``GuardConfig`` option (``extra`` included; ``config.flat_options``)
  except those in ``NOT_FINGERPRINTED``, which change what is observed or recorded, not the
  training;
- ``checkpoint``: the newest good checkpoint, relative to ``run_dir`` (None: a fresh start);
- ``data``: the watched iterable's type and ``len``, its dataset's type and ``len``, its
  ``batch_size`` (what is cheap and the same on every rank); None when nothing was watched;
- ``entry``: the main script's file name and SHA-256 (torchrun runs the file again on each
  restart, so an edit between attempts is a change).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.config import GuardConfig, flat_options
from trainguard.errors import LossScaleCollapseError, NonFiniteError
from trainguard.events import to_jsonable
from trainguard.recovery import checkpoint as ckpt
from trainguard.runs.identity import latest_run

logger = logging.getLogger(__name__)

STOP_FILE = "stop.json"
CLEARED_FILE = "stop-cleared.json"
"""In ``run_dir/recovery/``: the last record an attempt went past (kept as evidence)."""
FORMAT = 1

NOT_FINGERPRINTED = frozenset(
    {
        "run_dir",
        "run",
        "capture",
        "recovery.resume",
        "recovery.keep_checkpoints",
        "hang.timeout",
        "hang.mark_saves",
        "history.steps",
        "history.metrics_lines_per_second",
        "health.detect_stragglers",
        "health.straggler_warmup",
        "health.straggler_slowdown",
    }
)
"""Config fields that change what is observed or kept, not what a restart would train."""


@dataclass(frozen=True)
class StopRecord:
    step: int
    cause: str
    """``nonfinite``, ``spike`` or ``loss_scale``."""
    message: str
    bundle: str | None
    checkpoint: str | None
    """The checkpoint a restart resumes from, relative to ``run_dir`` (None: a fresh start)."""
    fingerprint: str
    inputs: dict[str, Any]
    """What the fingerprint hashes: ``config``, ``checkpoint``, ``data``, ``entry``."""
    attempt: int
    """``TORCHELASTIC_RESTART_COUNT`` of the attempt that stopped."""
    time: float = field(default_factory=time.time)
    format: int = FORMAT
    run: str | None = None
    """The run that stopped (``trainguard.runs.identity``; None in older records)."""


def stop_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / STOP_FILE


def cause_of(error: NonFiniteError, cause: str | None = None) -> str:
    """The cause of a stop: ``cause`` when the caller knows it (``"spike"``), else the error's."""
    if cause is not None:
        return cause
    return "loss_scale" if isinstance(error, LossScaleCollapseError) else "nonfinite"


def config_inputs(config: GuardConfig) -> dict[str, Any]:
    """The config fields a restart's training depends on, as JSON values."""
    values = {
        name: value for name, value in flat_options(config).items() if name not in NOT_FINGERPRINTED
    }
    jsonable: dict[str, Any] = to_jsonable(values)
    return jsonable


def _size(obj: Any) -> int | None:
    try:
        return len(obj)
    except Exception:  # an IterableDataset's loader raises TypeError; others anything
        return None


def _kind(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def data_identity(iterable: Any) -> dict[str, Any] | None:
    """What is cheap to know of the watched data and the same on every rank (None: unknown)."""
    if iterable is None:
        return None
    out: dict[str, Any] = {"type": _kind(iterable), "len": _size(iterable)}
    dataset = getattr(iterable, "dataset", None)
    if dataset is not None:
        out["dataset"] = _kind(dataset)
        out["dataset_len"] = _size(dataset)
    batch_size = getattr(iterable, "batch_size", None)
    if isinstance(batch_size, int):
        out["batch_size"] = batch_size
    return out


def entry_identity() -> dict[str, Any] | None:
    """The main script's name and SHA-256, or None (an interactive session, no file)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path:
        return None
    try:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None
    return {"file": Path(path).name, "sha256": digest}


def fingerprint_inputs(
    config: GuardConfig, checkpoint: str | None, data: dict[str, Any] | None
) -> dict[str, Any]:
    """What the fingerprint hashes, as it reads back from JSON (so a record compares equal)."""
    inputs = {
        "config": config_inputs(config),
        "checkpoint": checkpoint,
        "data": data,
        "entry": entry_identity(),
    }
    normal: dict[str, Any] = json.loads(json.dumps(inputs, default=str))
    return normal


def fingerprint(inputs: dict[str, Any]) -> str:
    text = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def changed_inputs(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Which inputs differ: ``config.FIELD`` per config field, else the input's name."""
    changed: list[str] = []
    old_config, new_config = before.get("config") or {}, now.get("config") or {}
    for name in sorted(set(old_config) | set(new_config)):
        if old_config.get(name) != new_config.get(name):
            changed.append(f"config.{name}")
    for key in ("checkpoint", "data", "entry"):
        if before.get(key) != now.get(key):
            changed.append(key)
    return changed


def relative_checkpoint(run_dir: Path, path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).relative_to(run_dir).as_posix()
    except ValueError:
        return Path(path).as_posix()


def newest_good(run_dir: Path) -> str | None:
    """The checkpoint a restart with ``resume=True`` would resume from, relative to run_dir."""
    good = ckpt.good_checkpoints(run_dir)
    return relative_checkpoint(run_dir, good[0]) if good else None


def build_record(
    config: GuardConfig,
    error: NonFiniteError,
    data: Any,
    attempt: int,
    cause: str | None = None,
) -> StopRecord:
    run_dir = Path(config.run_dir)
    checkpoint = newest_good(run_dir)
    inputs = fingerprint_inputs(config, checkpoint, data_identity(data))
    return StopRecord(
        step=error.step,
        cause=cause_of(error, cause),
        message=str(error),
        bundle=str(error.bundle) if error.bundle is not None else None,
        checkpoint=checkpoint,
        fingerprint=fingerprint(inputs),
        inputs=inputs,
        attempt=attempt,
        run=latest_run(run_dir),  # rank 0's newest event is this run's stop
    )


def write_record(run_dir: Path | str, record: StopRecord) -> Path:
    path = stop_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    ckpt.write_atomic(path, json.dumps(asdict(record), indent=1, default=str))
    return path


def read_record(run_dir: Path | str) -> StopRecord | None:
    """The record, or None when there is none (or it cannot be read: said in the log)."""
    path = stop_path(run_dir)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return StopRecord(**raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("trainguard: ignoring the unreadable stop record %s: %s", path, exc)
        return None


def record_stop(
    config: GuardConfig,
    rank: int,
    error: NonFiniteError,
    data: Any,
    attempt: int,
    cause: str | None = None,
) -> Path | None:
    """Rank 0 writes ``run_dir/stop.json`` for the guard's final stop; never raises."""
    if rank != 0:
        return None
    try:
        record = build_record(config, error, data, attempt, cause)
        path = write_record(config.run_dir, record)
    except Exception as exc:  # the stop itself must go on: the record is evidence only
        logger.warning("trainguard: could not write the stop record: %s", exc)
        return None
    logger.debug("trainguard: stop recorded in %s (%s)", path, record.fingerprint)
    return path


def retire_record(run_dir: Path | str, how: dict[str, Any]) -> Path | None:
    """Move ``stop.json`` to ``recovery/stop-cleared.json`` with ``cleared``: ``how``."""
    source = stop_path(run_dir)
    target = Path(run_dir) / "recovery" / CLEARED_FILE
    try:
        raw = json.loads(source.read_text(encoding="utf-8"))
        target.parent.mkdir(parents=True, exist_ok=True)
        raw["cleared"] = {**how, "time": time.time()}
        ckpt.write_atomic(target, json.dumps(raw, indent=1, default=str))
        source.unlink()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("trainguard: could not clear the stop record %s: %s", source, exc)
        return None
    return target
