"""trainguard: keeps PyTorch training runs alive and debuggable.

The names below are imported when first used (PEP 562): ``import trainguard`` alone imports
no torch, so ``trainguard --version``, ``trainguard report`` and the bootstrap of
``trainguard run`` pay only for what they use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard.config import (
    GuardConfig,
    HangConfig,
    HealthConfig,
    HistoryConfig,
    InputConfig,
    RecoveryConfig,
    RerunConfig,
    SpikeConfig,
)
from trainguard.errors import (
    BundleError,
    ConfigError,
    LossScaleCollapseError,
    NonFiniteError,
    PeerFailureError,
    ReplayError,
    ReplicaDivergenceError,
    SpikeError,
    TrainGuardError,
)
from trainguard.events import read_events
from trainguard.exitcodes import (
    EXIT_DO_NOT_RESTART,
    EXIT_HANG,
    EXIT_PEER_FAILURE,
    EXIT_SUSPECT_HOST,
)
from trainguard.lazy_names import lazy_names
from trainguard.replay import replay  # the function (the subpackage's own name: its docstring)

if TYPE_CHECKING:
    from trainguard.capture import Bundle, load_bundle
    from trainguard.replay import ReplayReport, ReplaySpec, diagnose, trace
    from trainguard.step import Decision, Guard

__version__ = "0.1.0"

__all__ = [
    "Bundle",
    "BundleError",
    "ConfigError",
    "Decision",
    "EXIT_DO_NOT_RESTART",
    "EXIT_HANG",
    "EXIT_SUSPECT_HOST",
    "EXIT_PEER_FAILURE",
    "Guard",
    "GuardConfig",
    "HangConfig",
    "HealthConfig",
    "HistoryConfig",
    "InputConfig",
    "RecoveryConfig",
    "RerunConfig",
    "SpikeConfig",
    "LossScaleCollapseError",
    "NonFiniteError",
    "PeerFailureError",
    "ReplayError",
    "ReplicaDivergenceError",
    "SpikeError",
    "TrainGuardError",
    "__version__",
    "ReplayReport",
    "ReplaySpec",
    "load_bundle",
    "read_events",
    "replay",
    "diagnose",
    "trace",
]

_LAZY = {
    "Bundle": "trainguard.capture",
    "load_bundle": "trainguard.capture",
    "ReplayReport": "trainguard.replay.report",
    "ReplaySpec": "trainguard.replay.factory",
    "diagnose": "trainguard.replay.live",
    "trace": "trainguard.replay.live",
    "Decision": "trainguard.step",
    "Guard": "trainguard.step",
}
"""The public names that import torch, and where they live."""


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
