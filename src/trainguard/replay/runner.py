"""Replay a captured step anywhere and say what went wrong.

``replay(bundle, factory)`` rebuilds the model with the user's factory, loads the captured
weights (FSDP2 shards are gathered into the unsharded model in this one process), restores
the RNG states, and re-runs forward, loss and backward on the captured micro-batches:

0. which rank to replay (origin.py): the rank that made the non-finite values, not one
   that received them through the gradient all-reduce; and the autocast state the step's
   forward ran under (autocast.py);
1. ``repeats`` runs: is the step non-finite again (``reproduced``), and are the runs bitwise
   equal (``deterministic``)?
2. one run under the tracer (localize.py): the ``phase``, the first ``op`` that made a
   non-finite value from finite inputs, its ``module`` and ``source`` line (backward ops
   are traced to the forward op they differentiate); under float16/bfloat16 autocast one
   more run in float32;
3. bisection over the samples (bisect.py): the ``culprit_samples``;
4. a ``verdict`` and a one-sentence ``summary`` (diagnosis.py), and whether the ranks'
   replicated weights agree (replicas.py).

The factory (factory.py) takes no arguments and returns ``(model, loss_fn)`` or a
:class:`ReplaySpec`; ``loss_fn(model, batch)`` returns the scalar loss of one (micro-)batch.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainguard.capture.bundle import Bundle, load_bundle
from trainguard.capture.rng import rng_state, set_rng_state
from trainguard.errors import BundleError, ReplayError
from trainguard.replay import autocast as precision
from trainguard.replay import origin
from trainguard.replay.engine import diagnose_runs
from trainguard.replay.explain import explain
from trainguard.replay.factory import Factory, ReplaySpec, resolve_factory
from trainguard.replay.factory import first_line as _line
from trainguard.replay.optimizer import OptimizerView, view_of_state
from trainguard.replay.replicas import apply_replicas, check_replicas
from trainguard.replay.report import KEYS, ReplayReport
from trainguard.replay.stepper import RunResult, StepRunner

logger = logging.getLogger(__name__)

__all__ = ["KEYS", "ReplayReport", "ReplaySpec", "load_weights", "replay", "resolve_factory"]


# -- weights ---------------------------------------------------------------------------------


def load_weights(model: nn.Module, bundle: Bundle, rank: int) -> None:
    """Load the captured weights into ``model`` (ReplayError when they do not fit it)."""
    if bundle.sharded:
        _load_shards(model, bundle)
        return
    state = bundle.model_state(rank)
    _check_fit(model, {k: tuple(v.shape) for k, v in state.items()}, f"rank-{rank}/model.pt")
    model.load_state_dict(state)


def _check_fit(model: nn.Module, saved: dict[str, tuple[int, ...]], where: str) -> None:
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    shapes = [
        f"{k} {list(saved[k])} vs {list(wanted[k])}"
        for k in wanted
        if k in saved and saved[k] != wanted[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected {_few(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch {_few(shapes)} (bundle vs model)")
    if problems:
        raise ReplayError(
            f"the weights in {where} do not fit the factory's model ({'; '.join(problems)}); "
            "--factory must build the model of the training run"
        )


def _few(items: list[str], n: int = 3) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def _load_shards(model: nn.Module, bundle: Bundle) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = FileSystemReader(str(bundle.dcp_path))
    try:
        metadata = reader.read_metadata()
    except Exception as exc:
        raise BundleError(bundle.dcp_path, f"cannot read the DCP metadata: {_line(exc)}") from exc
    saved = {
        key.removeprefix("model."): tuple(getattr(meta, "size", ()))
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }
    _check_fit(model, saved, "dcp/ (FSDP2 shards)")
    target = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        try:
            load(target, storage_reader=reader, no_dist=True)
        except Exception as exc:
            raise BundleError(bundle.dcp_path, f"cannot load the shards: {_line(exc)}") from exc
    model.load_state_dict(target["model"])


# -- replay ------------------------------------------------------------------------------------


def _check_rng(rng: dict[str, Any] | None, bundle: Bundle, rank: int) -> None:
    if rng is None:
        return
    saved = rng_state()
    try:
        set_rng_state(rng)
    except Exception as exc:
        raise BundleError(
            bundle.rank_dir(rank) / "rng.pt",
            f"holds RNG states that cannot be restored: {_line(exc)}",
        ) from exc
    finally:
        set_rng_state(saved)


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ReplayError(
            f"--device {name!r}: not a device ({_line(exc)}); use cpu or cuda"
        ) from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ReplayError(f"--device {name}: CUDA is not available here; use --device cpu")
    return device


@dataclass
class _Rank:
    """One rank's part of the bundle, ready to run."""

    runner: StepRunner
    meta: dict[str, Any]
    autocast: precision.Autocast


def optimizer_view(bundle: Bundle, rank: int, model: nn.Module) -> OptimizerView | None:
    """The rank's captured optimizer state, its parameters named by ``model``'s (None: not
    in the bundle, FSDP2 shards, or unreadable)."""
    if bundle.sharded or f"rank-{rank}/optimizer.pt" not in bundle.files:
        return None
    try:
        state = bundle.optimizer_state(rank)
    except (BundleError, RuntimeError, OSError) as exc:
        logger.info("trainguard: replay reads no optimizer state: %s", exc)
        return None
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    return view_of_state(state, named)


def _prepare(
    bundle: Bundle, spec: ReplaySpec, rank: int, device: torch.device, autocast: str | None
) -> _Rank:
    """Load rank ``rank``'s weights, mode, RNG and batches into a runner on ``device``."""
    meta = {**bundle.meta(rank), "world_size": bundle.world_size}
    if not meta.get("batch_stored", True):
        raise ReplayError(
            f"{bundle.path}: rank {rank} stored no batch (the loop did not iterate "
            "guard.watch(loader)); nothing to replay"
        )
    model = spec.model
    load_weights(model, bundle, rank)
    model.to(device)
    model.train(bool(meta.get("model_training", True)))
    rng = bundle.rng(rank)
    _check_rng(rng, bundle, rank)
    state = precision.resolve(meta.get("autocast"), autocast, device)
    runner = StepRunner(model, spec.loss_fn, bundle.batches(rank), rng, device, state)
    return _Rank(runner, meta, state)


def _qualified(func: object) -> str:
    """``module.qualname`` of the factory's loss_fn (its type's, for a callable object)."""
    named = func if hasattr(func, "__qualname__") else type(func)
    return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', '?')}"


def replay(
    bundle: Bundle | Path | str,
    factory: str | Factory | ReplaySpec,
    *,
    rank: int | None = None,
    repeats: int = 3,
    device: str = "cpu",
    bisect: bool = True,
    autocast: str | None = None,
) -> ReplayReport:
    """Replay a bundle's step on ``device`` and diagnose it (see the module docstring).

    ``rank``: whose part to replay (default: the rank where the non-finite values arose,
    see origin.py). ``autocast``: ``"off"``, ``"float16"`` or ``"bfloat16"`` instead of the
    autocast state the bundle recorded. Raises BundleError for a bad bundle, ReplayError
    when the factory or weights do not fit.
    """
    start = time.monotonic()
    if repeats < 1:
        raise ReplayError(f"--repeats {repeats}: use 1 or more")
    precision.check_option(autocast)
    opened = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    target = _device(device)
    spec = resolve_factory(factory, opened.factory_config)

    def run_rank(r: int) -> RunResult:
        return _prepare(opened, spec, r, target, autocast).runner.run(strict=True)

    found = origin.find_origin(opened, rank, run_rank)
    who = found.rank
    part = _prepare(opened, spec, who, target, autocast)
    runs = [part.runner.run(strict=True) for _ in range(repeats)]
    spike = opened.trigger == "spike"
    view = functools.cache(lambda: optimizer_view(opened, who, spec.model))
    report = diagnose_runs(
        part.runner, runs, part.meta, str(target), bisect, opened.history, spike, view
    )
    report.details["loss_fn"] = _qualified(spec.loss_fn)
    explain(report, found, opened, run_rank, part.autocast)
    replicas = check_replicas(opened, [name for name, _ in spec.model.named_parameters()])
    apply_replicas(report, replicas, who)
    report.details.update(
        bundle=str(opened.path),
        step=opened.step,
        rank=who,
        world_size=opened.world_size,
        trigger=opened.trigger,
        device=str(target),
        repeats=repeats,
        autocast=part.autocast.to_dict(),
        **found.to_details(),
        replicas=replicas.to_dict(),
        recorded={
            "loss": part.meta.get("loss"),
            "micro_losses": part.meta.get("micro_losses"),
            "grad_norm": part.meta.get("grad_norm"),
            "nonfinite_params": part.meta.get("nonfinite_params"),
        },
        seconds=round(time.monotonic() - start, 3),
    )
    return report
