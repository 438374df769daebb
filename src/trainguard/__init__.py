"""trainguard: keeps PyTorch training runs alive and debuggable."""

from trainguard.capture import Bundle, load_bundle
from trainguard.config import GuardConfig
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
from trainguard.replay import ReplayReport, ReplaySpec, diagnose, replay, trace
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
