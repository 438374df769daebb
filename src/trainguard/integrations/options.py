"""The Guard's options as an integration takes them: every ``GuardConfig`` field by name."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainguard.config import GuardConfig
from trainguard.errors import ConfigError
from trainguard.recovery import recovery_enabled

OWNED_BY_FRAMEWORK = ("accumulation_steps",)
"""Options the integration reads from the framework instead (e.g. accumulate_grad_batches)."""


def guard_config(options: dict[str, Any], where: str) -> GuardConfig:
    """A validated GuardConfig from keyword options (ConfigError for an unknown one)."""
    known = {f.name for f in dataclasses.fields(GuardConfig)} - set(OWNED_BY_FRAMEWORK)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            unknown[0], f"{where} got an unknown option; use one of {', '.join(sorted(known))}"
        )
    config = GuardConfig(**options)
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
