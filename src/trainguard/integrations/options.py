"""The Guard's options as an integration takes them: by name, through the one path every
way in uses (``config.options_config``: ``Guard`` keywords, core fields, ``section.field``
as ``**{"spikes.warmup": 20}``, or a whole section: ``spikes=SpikeConfig(...)``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainguard.config import GuardConfig, options_config
from trainguard.errors import ConfigError
from trainguard.recovery import recovery_enabled

OWNED_BY_FRAMEWORK = ("accumulation_steps",)
"""Options the integration reads from the framework instead (e.g. accumulate_grad_batches)."""


def guard_config(options: dict[str, Any], where: str) -> GuardConfig:
    """A validated GuardConfig from keyword options (ConfigError for an unknown one, naming
    the closest known option)."""
    owned = sorted(set(options) & set(OWNED_BY_FRAMEWORK))
    if owned:
        raise ConfigError(
            owned[0], f"{where} takes it from the framework (its own gradient accumulation)"
        )
    config = options_config(options)
    if recovery_enabled(config):
        raise ConfigError(
            "on_escalation/checkpoint_every/resume",
            f"{where} does not run the guard's recovery: the framework owns the checkpoints "
            "and the data loader (a rollback must skip data through guard.watch()); use the "
            "framework's checkpoints and resume, with on_escalation='raise'",
        )
    return config


def pop_log_metrics(options: dict[str, Any], where: str) -> bool:
    """The integration's ``log_metrics`` option (True by default), taken out of the Guard's
    options: whether ``guard.metrics()`` goes to the framework's loggers."""
    log_metrics = options.pop("log_metrics", True)
    if not isinstance(log_metrics, bool):
        raise ConfigError(
            "log_metrics",
            f"{where}(log_metrics=...) takes True or False, got {log_metrics!r}",
        )
    return log_metrics


def with_accumulation(config: GuardConfig, steps: int) -> GuardConfig:
    """The config with the framework's gradient accumulation (validated again)."""
    return dataclasses.replace(config, accumulation_steps=int(steps))
