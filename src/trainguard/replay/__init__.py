"""Replay: re-run a captured step anywhere and say what went wrong.

- ``runner``    ``replay()``: rebuild the model, load the bundle, re-run, diagnose
- ``factory``   ``--factory MODULE:FUNC``: imported and called as a script would run them
- ``origin``    which rank made the non-finite values, which only received them
- ``autocast``  the autocast state the step ran under, re-entered on the replay's device
- ``replicas``  replicated parameters that differ across the bundle's ranks
- ``explain``   what a multi-rank or finite replay says beyond the diagnosis
- ``live``      ``trace()`` / ``diagnose()``: the same diagnosis on live objects
- ``engine``    runs -> report, shared by both
- ``stepper``   one forward/loss/backward of the captured micro-batches
- ``localize``  the tracer: root op, NaN-maker, the hops between them and the loss;
  ``hops``: its records (origins, hops)
- ``masks``     mask values written on purpose; reductions over fully masked rows;
  ``masked_reads``: an op that reads a mask's -inf where the mask covers only part of a row
- ``sites``     module stack and the user's source line; ``seeds``: pre-step non-finite
  (the batch, the weights, a loss module's buffers); ``external``: tensors made before the
  step outside the model and the batch
- ``weights``   weights non-finite before the step: ``rows`` (rows only some samples read,
  ever updated?), ``writer`` (which update wrote them, through which param group and
  hyper-parameter), ``optimizer`` (the optimizer's groups and state, by parameter name)
- ``chain``     the path and the roots as plain data
- ``bisect``    the culprit samples
- ``diagnosis`` the finding (phase, root, samples); ``sentences``: the summary sentence;
  ``verdicts``: the class and its advice
- ``report``    ``ReplayReport`` and its ``KEYS``
- ``render``    text for the CLI (inspect, replay, demo)

Offers: ``replay``, ``ReplayReport``, ``ReplaySpec``, ``trace``, ``diagnose`` (imported when first
used: no torch at import). Reads bundles through
``trainguard.capture``; never imports the step path or the watchdog.

Note: ``trainguard.replay`` (the attribute of the top-level package) is the *function*
``replay``; import this package's modules by their full name
(``from trainguard.replay.runner import ...``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.capture.bundle import Bundle
    from trainguard.replay.factory import Factory, ReplaySpec
    from trainguard.replay.live import Trace, diagnose, trace
    from trainguard.replay.report import ReplayReport

__all__ = ["ReplayReport", "ReplaySpec", "Trace", "diagnose", "replay", "trace"]


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
    """Replay a bundle's step on ``device`` and diagnose it (``runner.replay``: imported at
    the first call, so ``import trainguard`` imports no torch).

    ``rank``: whose part to replay (default: the rank where the non-finite values arose).
    ``autocast``: ``"off"``, ``"float16"`` or ``"bfloat16"`` instead of the autocast state
    the bundle recorded. Raises BundleError for a bad bundle, ReplayError when the factory or
    weights do not fit."""
    from trainguard.replay import runner

    return runner.replay(
        bundle,
        factory,
        rank=rank,
        repeats=repeats,
        device=device,
        bisect=bisect,
        autocast=autocast,
    )


_LAZY = {
    "ReplayReport": "trainguard.replay.report",
    "ReplaySpec": "trainguard.replay.factory",
    "Trace": "trainguard.replay.live",
    "diagnose": "trainguard.replay.live",
    "trace": "trainguard.replay.live",
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'trainguard.replay' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value
