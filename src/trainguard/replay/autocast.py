"""The autocast state a replay runs the forward pass and the loss under.

The guard records in each rank's ``meta.json`` the autocast state the step's forward ran
under (``"autocast"``: ``{"enabled", "device_type", "dtype"}``, or null when unknown).
Replay re-enters it around ``loss_fn(model, batch)`` (the backward runs outside, as torch
recommends), on the replay's device: a bundle recorded under CUDA autocast and replayed on
the CPU runs under CPU autocast with the same dtype, and the report says so. ``--autocast
off|float16|bfloat16`` (``autocast=`` of ``replay()``) overrides what the bundle recorded.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.errors import ReplayError

logger = logging.getLogger(__name__)

CHOICES = ("off", "float16", "bfloat16")
"""What ``--autocast`` accepts."""
HALF = ("float16", "bfloat16")


@dataclass(frozen=True)
class Autocast:
    """The autocast a replay uses, and where that choice came from."""

    enabled: bool
    device_type: str
    dtype: str | None
    source: str
    """``bundle`` (as recorded), ``option`` (``--autocast``) or ``unknown`` (not recorded)."""
    recorded: dict[str, Any] | None = None
    """What the bundle recorded (None: nothing)."""

    @property
    def half(self) -> str | None:
        """``float16`` / ``bfloat16`` when enabled with a half dtype, else None."""
        return self.dtype if self.enabled and self.dtype in HALF else None

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """The ``torch.autocast`` to run the forward pass and the loss under."""
        if not self.enabled or self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=getattr(torch, self.dtype))

    def text(self) -> str:
        """E.g. ``float16 on cpu (the bundle recorded cuda autocast float16; ...)``."""
        used = f"{self.dtype} on {self.device_type}" if self.enabled else "off (float32)"
        return f"{used} ({self._why()})"

    def _why(self) -> str:
        if self.source == "option":
            return f"--autocast {self.dtype if self.enabled else 'off'}"
        if self.source == "unknown":
            return "the bundle did not record the autocast state"
        recorded = self.recorded or {}
        if not recorded.get("enabled"):
            return "as recorded: the step ran without autocast"
        where, dtype = recorded.get("device_type"), recorded.get("dtype")
        if where != self.device_type:
            return f"recorded {where} autocast {dtype}, run as {self.device_type} autocast here"
        return "as recorded"

    def to_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "device_type": self.device_type,
            "dtype": self.dtype,
            "source": self.source,
            "recorded": self.recorded,
            "text": self.text(),
        }


OFF = Autocast(False, "cpu", None, "unknown")
"""No autocast (live diagnosis, or nothing known)."""


def check_option(value: str | None) -> str | None:
    """``value`` when it is a valid ``--autocast`` choice (or None); ReplayError otherwise."""
    if value is None or value in CHOICES:
        return value
    raise ReplayError(
        f"--autocast {value!r}: use one of {', '.join(CHOICES)} (or leave it out to replay "
        "under the autocast state the bundle recorded)"
    )


def resolve(recorded: Any, option: str | None, device: torch.device) -> Autocast:
    """The autocast to replay under: ``option`` when given, else what the bundle ``recorded``
    (its ``meta.json`` ``"autocast"``), on ``device``'s type."""
    saved = recorded if isinstance(recorded, dict) else None
    if check_option(option) is not None:
        enabled = option != "off"
        return Autocast(enabled, device.type, option if enabled else None, "option", saved)
    if saved is None:
        return Autocast(False, device.type, None, "unknown", None)
    dtype = _dtype_name(saved.get("dtype"))
    enabled = bool(saved.get("enabled")) and dtype is not None
    if saved.get("enabled") and dtype is None:
        logger.warning("trainguard: the bundle's autocast dtype %r is unknown", saved.get("dtype"))
    return Autocast(enabled, device.type, dtype if enabled else None, "bundle", saved)


def _dtype_name(value: Any) -> str | None:
    """``float16`` from ``float16`` / ``torch.float16`` / ``half``; None when not a dtype."""
    if not isinstance(value, str):
        return None
    name = value.removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return None
    return str(dtype).removeprefix("torch.")


OTHERWISE_ADVICE = (
    "Replay the step under the autocast it ran under (leave out --autocast): a step that is "
    "non-finite under float16 or bfloat16 autocast and finite in float32 is an overflow of "
    "that dtype, not a fault of the device."
)


def unrecorded_note(used: Autocast) -> str:
    """For a finite replay of a bundle that did not record its autocast state."""
    if used.source != "unknown" or used.enabled:
        return ""
    return (
        " The bundle did not record the autocast state and the replay ran in float32: if "
        "the loop ran under autocast, replay with --autocast float16 or bfloat16."
    )


def otherwise_summary(used: Autocast) -> str | None:
    """For a finite replay under ``--autocast`` other than the half autocast the step ran
    under: the summary (the device is no suspect); None when it ran as recorded."""
    recorded = used.recorded or {}
    ran_half = bool(recorded.get("enabled")) and recorded.get("dtype") in HALF
    if used.source != "option" or not ran_half or used.dtype == recorded.get("dtype"):
        return None
    return (
        f"The step is finite when replayed under {used.text()}, but it ran under "
        f"{recorded.get('device_type')} autocast {recorded.get('dtype')}: replay without "
        "--autocast to run it as it ran."
    )


def any_autocast(device_type: str) -> bool:
    """Whether autocast is in force now for ``device_type`` or the CPU."""
    try:
        return any(torch.is_autocast_enabled(kind) for kind in dict.fromkeys((device_type, "cpu")))
    except TypeError:  # torch < 2.4: no device argument
        return bool(torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled())
