"""trainguard: keeps PyTorch training runs alive and debuggable."""

from trainguard.config import GuardConfig
from trainguard.errors import (
    BundleError,
    ConfigError,
    LossScaleCollapseError,
    NonFiniteError,
    PeerFailureError,
    ReplayError,
    TrainGuardError,
)
from trainguard.events import read_events
from trainguard.guard import Guard
from trainguard.policy import Decision

__version__ = "0.1.0"

__all__ = [
    "BundleError",
    "ConfigError",
    "Decision",
    "Guard",
    "GuardConfig",
    "LossScaleCollapseError",
    "NonFiniteError",
    "PeerFailureError",
    "ReplayError",
    "TrainGuardError",
    "__version__",
    "read_events",
]
