"""Options as a file or a command line names them: an option's value typed as text
(``"20"``, ``"none"``, ``"true"``, ``"a,b"``) turned into its type (``parsed_value``), and
the error of an unknown name, naming the closest known one or where a flat option of before
went (``RENAMED``, ``DROPPED``)."""

from __future__ import annotations

import difflib
import json
import math
import types
import typing
from pathlib import Path
from typing import Literal

from trainguard.errors import ConfigError

RENAMED: dict[str, str] = {
    **{f"spike_{key}": f"spikes.{key}" for key in ("z", "ratio", "beta", "warmup")},
    "spike_max_consecutive": "spikes.max_consecutive",
    **{key: f"recovery.{key}" for key in ("snapshot_every", "good_after", "max_rollbacks")},
    **{key: f"recovery.{key}" for key in ("skip_margin", "lr_backoff", "lr_backoff_steps")},
    "check_inputs": "inputs.check",
    "ignore_inputs": "inputs.ignore",
    "allow_masks": "inputs.allow_masks",
    "detect_stragglers": "health.detect_stragglers",
    "straggler_warmup": "health.straggler_warmup",
    "straggler_slowdown": "health.straggler_slowdown",
    "suspect_host_after": "rerun.suspect_host_after",
    "mark_saves": "hang.mark_saves",
    "history_steps": "history.steps",
    "metrics_lines_per_second": "history.metrics_lines_per_second",
}
"""Options that were ``GuardConfig`` fields before the sections, and their names now."""

DROPPED: dict[str, str] = {
    "spike_grace": "the spike rule's LR grace is 50 steps",
    "zero_lr_steps": "the ladder's last rung runs 5 steps at LR 0",
    "loss_tolerance": "a loss_mismatch event is written past a relative difference of 0.5",
    "straggler_window": "a straggler is judged over 40 steps",
    "straggler_min_lost": "a straggler must cost the job 10 ms a step",
    "suspect_host_window": "transient faults are counted over 1,000 steps",
    "max_recorded_steps": "guard.state.nonfinite_steps keeps the last 100",
}
"""Options no user set, dropped (their values are fixed), and what they were."""


def unknown_option(name: str, known: list[str]) -> typing.NoReturn:
    """Raise the ``ConfigError`` of an unknown option ``name``: where a flat option of before
    went, or the closest of the ``known`` names."""
    if name in RENAMED:
        raise ConfigError(name, f"this option is {RENAMED[name]} now (docs/options.md)")
    if name in DROPPED:
        raise ConfigError(name, f"no longer an option: {DROPPED[name]}")
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(
        name,
        f"no such option; {hint}the options are GuardConfig's fields and its sections' "
        "(section.option, e.g. spikes.warmup): docs/options.md",
    )


def parsed_value(kind: type, key: str, value: object, option: str) -> object:
    """A command line's ``value`` for option ``key`` of dataclass ``kind``, as its type."""
    if not isinstance(value, str):
        return value
    hint = typing.get_type_hints(kind)[key]
    text = value.strip()
    allowed = set(_leaves(hint))
    if type(None) in allowed and text.lower() in ("none", "null", ""):
        return None
    if bool in allowed:
        if text.lower() in ("true", "yes", "on", "1"):
            return True
        if text.lower() in ("false", "no", "off", "0"):
            return False
    for number in (int, float):
        if number in allowed:
            try:
                return number(text) if number is int else _float(text)
            except ValueError:
                pass
    if tuple in allowed:
        return tuple(part for part in text.split(",") if part)
    if dict in allowed:
        try:
            return json.loads(text)
        except ValueError:
            raise ConfigError(option, f"got {value!r}; use a JSON object") from None
    if str in allowed or Path in allowed:
        return text
    words = {int: "an integer", float: "a number", bool: "true or false", type(None): "none"}
    wanted = " or ".join(words.get(kind, getattr(kind, "__name__", str(kind))) for kind in allowed)  # type: ignore[call-overload]
    raise ConfigError(option, f"got {value!r}; use {wanted}")


def _float(text: str) -> float:
    number = float(text)
    if math.isnan(number):
        raise ValueError(text)
    return number


def _leaves(hint: object) -> list[object]:
    origin = typing.get_origin(hint)
    if origin is None:
        return [hint]
    if origin is Literal:
        return [str]
    if origin in (typing.Union, types.UnionType):
        return [leaf for arg in typing.get_args(hint) for leaf in _leaves(arg)]
    return [origin]
