"""The checks every option's validation shares: each names the option as the user sets it in
its ``ConfigError`` and says what to use instead."""

from __future__ import annotations

import json
import typing
from typing import Any

from trainguard.errors import ConfigError


def check_choice(option: str, value: object, action: Any) -> None:
    choices = typing.get_args(action)
    if value not in choices:
        raise ConfigError(option, f"got {value!r}; use one of {', '.join(choices)}")


def check_integer(option: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(option, f"got {value!r}; use an integer >= {low}")


def check_json_able(option: str, value: object) -> None:
    if not isinstance(value, dict):
        raise ConfigError(option, f"got {type(value).__name__}; use a dict")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            option, f"not JSON-able ({exc}); use plain numbers, strings, lists"
        ) from None


def check_flag(option: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(option, f"got {value!r}; use True or False")


def check_ignore_inputs(names: object) -> None:
    """``inputs.ignore`` must be a tuple (or list) of non-empty names."""
    if isinstance(names, str):
        raise ConfigError(
            "inputs.ignore",
            f"got the string {names!r}; use a tuple of names: inputs.ignore=({names!r},)",
        )
    if not isinstance(names, tuple | list) or not all(
        isinstance(name, str) and name for name in names
    ):
        raise ConfigError(
            "inputs.ignore",
            f"got {names!r}; use a tuple of batch keys or paths, e.g. ('attention_mask',)",
        )
