"""Replay a captured step anywhere and say what went wrong.

``replay(bundle, factory)`` rebuilds the model with the user's factory, loads the captured
weights (FSDP2 shards are gathered into the unsharded model in this one process), restores
the RNG states, and re-runs forward, loss and backward on the captured micro-batches:

1. ``repeats`` runs: is the step non-finite again (``reproduced``), and are the runs bitwise
   equal (``deterministic``)?
2. one run under the tracer (localize.py): the ``phase``, the first ``op`` that made a
   non-finite value from finite inputs, its ``module`` and ``source`` line (backward ops
   are traced to the forward op they differentiate);
3. bisection over the samples (bisect.py): the ``culprit_samples``;
4. a ``verdict`` and a one-sentence ``summary`` (diagnosis.py).

The factory takes no arguments and returns ``(model, loss_fn)`` or a :class:`ReplaySpec`;
``loss_fn(model, batch)`` returns the scalar loss of one (micro-)batch.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from trainguard.capture import batchtree
from trainguard.capture.bundle import Bundle, load_bundle
from trainguard.capture.rng import rng_state, set_rng_state
from trainguard.errors import BundleError, ReplayError
from trainguard.replay.bisect import find_culprits
from trainguard.replay.diagnosis import Finding, locate, not_reproduced_summary, summarize
from trainguard.replay.stepper import RunResult, StepRunner

logger = logging.getLogger(__name__)

KEYS = (
    "reproduced",
    "deterministic",
    "phase",
    "op",
    "module",
    "source",
    "culprit_samples",
    "verdict",
    "summary",
)
"""The keys every replay report has, in this order (``--json`` prints more after them)."""


@dataclass
class ReplaySpec:
    """What a replay factory returns: the model (fresh weights are fine: the bundle's are
    loaded into it) and ``loss_fn(model, batch) -> scalar loss``."""

    model: nn.Module
    loss_fn: Callable[[nn.Module, Any], Tensor]


Factory = Callable[[], Any]


@dataclass
class ReplayReport:
    """The diagnosis of one captured step. ``to_dict()`` is what ``--json`` prints."""

    reproduced: bool
    deterministic: bool
    phase: str | None
    op: str | None
    module: str | None
    source: str | None
    culprit_samples: list[dict[str, Any]]
    verdict: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {key: getattr(self, key) for key in KEYS}
        out.update(self.details)
        return out


# -- factory ---------------------------------------------------------------------------------


def resolve_factory(factory: str | Factory | ReplaySpec) -> ReplaySpec:
    """A ReplaySpec from ``"module:func"`` / ``"path/to/file.py:func"``, a callable or a spec."""
    if isinstance(factory, ReplaySpec):
        return _checked(factory, "the ReplaySpec")
    name = factory if isinstance(factory, str) else getattr(factory, "__qualname__", "factory")
    func = _import_factory(factory) if isinstance(factory, str) else factory
    try:
        made = func()
    except Exception as exc:
        raise ReplayError(
            f"--factory {name}: calling it raised {type(exc).__name__}: {_line(exc)}"
        ) from exc
    if isinstance(made, ReplaySpec):
        return _checked(made, name)
    if isinstance(made, tuple) and len(made) == 2:
        return _checked(ReplaySpec(made[0], made[1]), name)
    raise ReplayError(
        f"--factory {name}: must return (model, loss_fn) or trainguard.ReplaySpec, got "
        f"{type(made).__name__}"
    )


def _checked(spec: ReplaySpec, name: str) -> ReplaySpec:
    if not isinstance(spec.model, nn.Module):
        raise ReplayError(
            f"--factory {name}: the model must be a torch.nn.Module, got "
            f"{type(spec.model).__name__}"
        )
    if not callable(spec.loss_fn):
        raise ReplayError(
            f"--factory {name}: loss_fn must be callable as loss_fn(model, batch), got "
            f"{type(spec.loss_fn).__name__}"
        )
    return spec


def _import_factory(spec: str) -> Factory:
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ReplayError(f"--factory: expected MODULE:FUNC (e.g. train:make_replay), got {spec!r}")
    module = _import_module(module_name, spec)
    func = module
    for part in attr.split("."):
        func = getattr(func, part, None)
        if func is None:
            raise ReplayError(f"--factory {spec}: {module_name} has no attribute {attr!r}")
    if not callable(func):
        raise ReplayError(f"--factory {spec}: {attr} is not callable")
    return cast(Factory, func)


def _import_module(name: str, spec: str) -> Any:
    try:
        if name.endswith(".py") or os.sep in name:
            path = Path(name)
            if not path.is_file():
                raise ReplayError(f"--factory {spec}: no such file {name}")
            loaded = importlib.util.spec_from_file_location(path.stem, path)
            if loaded is None or loaded.loader is None:
                raise ReplayError(f"--factory {spec}: cannot load {name}")
            module = importlib.util.module_from_spec(loaded)
            sys.modules.setdefault(path.stem, module)
            loaded.loader.exec_module(module)
            return module
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # like `python -m`: modules next to you import
        return importlib.import_module(name)
    except ReplayError:
        raise
    except Exception as exc:
        raise ReplayError(
            f"--factory {spec}: cannot import {name} ({type(exc).__name__}: {_line(exc)}); run "
            "from the folder that holds it or add it to PYTHONPATH"
        ) from exc


def _line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__


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


def _rank(bundle: Bundle, rank: int | None) -> int:
    if rank is None:
        return next((r for r in bundle.ranks if r in bundle.saved_ranks), bundle.saved_ranks[0])
    if rank not in bundle.saved_ranks:
        raise ReplayError(f"--rank {rank}: the bundle holds ranks {bundle.saved_ranks}")
    return rank


def replay(
    bundle: Bundle | Path | str,
    factory: str | Factory | ReplaySpec,
    *,
    rank: int | None = None,
    repeats: int = 3,
    device: str = "cpu",
    bisect: bool = True,
) -> ReplayReport:
    """Replay a bundle's step on ``device`` and diagnose it (see the module docstring).

    ``rank``: whose batch to replay (default: the first rank where the step went bad).
    Raises BundleError for a bad bundle, ReplayError when the factory or weights do not fit.
    """
    start = time.monotonic()
    if repeats < 1:
        raise ReplayError(f"--repeats {repeats}: use 1 or more")
    opened = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    who = _rank(opened, rank)
    meta = opened.meta(who)
    if not meta.get("batch_stored", True):
        raise ReplayError(
            f"{opened.path}: rank {who} stored no batch (the loop did not iterate "
            "guard.watch(loader)); nothing to replay"
        )
    target = _device(device)
    spec = resolve_factory(factory)
    model = spec.model
    load_weights(model, opened, who)
    model.to(target)
    model.train(bool(meta.get("model_training", True)))
    rng = opened.rng(who)
    _check_rng(rng, opened, who)
    runner = StepRunner(model, spec.loss_fn, opened.batches(who), rng, target)
    runs = [runner.run(strict=True) for _ in range(repeats)]
    report = _diagnose(runner, runs, meta, str(target), bisect)
    report.details.update(
        bundle=str(opened.path),
        step=opened.step,
        rank=who,
        world_size=opened.world_size,
        trigger=opened.trigger,
        device=str(target),
        repeats=repeats,
        recorded={
            "loss": meta.get("loss"),
            "micro_losses": meta.get("micro_losses"),
            "grad_norm": meta.get("grad_norm"),
            "nonfinite_params": meta.get("nonfinite_params"),
        },
        seconds=round(time.monotonic() - start, 3),
    )
    return report


def _diagnose(
    runner: StepRunner, runs: list[RunResult], meta: dict[str, Any], device: str, bisect: bool
) -> ReplayReport:
    bad = [r for r in runs if r.bad]
    deterministic = len({r.bits for r in runs}) == 1
    replayed = {
        "nonfinite_runs": len(bad),
        "replayed": {
            "losses": runs[0].losses,
            "grad_norm": runs[0].grad_norm,
            "nonfinite_params": runs[0].bad_params,
        },
    }
    if not bad:
        summary = not_reproduced_summary(runs, deterministic, device, meta)
        report = ReplayReport(
            False, deterministic, None, None, None, None, [], "not_reproduced", summary
        )
        report.details.update(replayed, **_finding_details(None), bisection_runs=0)
        return report
    micro = bad[0].first_bad_micro or 0
    finding = locate(runner, micro)
    culprits = _culprits(runner, finding) if bisect else Culprits(complete=False)
    summary = summarize(finding, culprits.samples, culprits.batch_level, culprits.complete)
    if len(bad) < len(runs):
        summary += f" (Non-finite in {len(bad)} of {len(runs)} replays: nondeterministic.)"
    report = ReplayReport(
        True,
        deterministic,
        finding.phase,
        finding.op,
        finding.module,
        finding.source,
        culprits.samples,
        finding.verdict,
        summary,
    )
    report.details.update(replayed, **_finding_details(finding), bisection_runs=culprits.runs)
    return report


def _finding_details(finding: Finding | None) -> dict[str, Any]:
    origin = finding.origin if finding is not None else None
    site = origin.site if origin else None
    backward = None
    if site is not None and site.phase == "backward":
        forward = site.forward
        backward = {
            "op": site.op,
            "grad_fn": site.grad_fn,
            "forward_op": forward.op if forward else None,
            "forward_module": forward.module if forward else None,
            "forward_source": forward.source if forward else None,
        }
    return {
        "op_detail": origin.detail if origin else None,
        "origin": origin.kind if origin else None,
        "code": site.code if site else None,
        "backward": backward,
        "batch_nonfinite": [o.detail for o in finding.input_origins] if finding else [],
        "weights_nonfinite": [o.label for o in finding.parameter_origins] if finding else [],
    }


@dataclass
class Culprits:
    samples: list[dict[str, Any]] = field(default_factory=list)
    """``{"micro_batch", "position", "index"}`` per culprit (index: dataset index or None)."""
    batch_level: bool = False
    complete: bool = True
    runs: int = 0


def _culprits(runner: StepRunner, finding: Finding) -> Culprits:
    """Bisect every micro-batch that is bad on its own; positions plus dataset indices."""
    backward = finding.phase == "backward"
    micros = range(len(runner.micro_batches))
    bad_micros = [
        m for m in micros if len(micros) == 1 or runner.run(micro=m, backward=backward).bad
    ]
    out = Culprits(runs=len(micros) if len(micros) > 1 else 0)
    for m in bad_micros:
        batch = runner.micro_batches[m]
        size = batchtree.batch_size(batch)
        if not size:
            out.batch_level = True
            continue
        indices = batchtree.dataset_indices(batch)

        def bad(positions: Any, m: int = m) -> bool:
            return runner.run(micro=m, positions=positions, backward=backward).bad

        found = find_culprits(bad, size)
        out.runs += found.runs
        out.batch_level |= found.batch_level
        out.complete &= found.complete
        for position in found.culprits:
            index = indices[position] if indices is not None and position < len(indices) else None
            out.samples.append({"micro_batch": m, "position": position, "index": index})
    out.batch_level &= not out.samples
    return out
