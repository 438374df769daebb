"""Capture bundles: the on-disk format, reading back, and what goes into one.

- ``bundle``    the format (manifest, checksums, atomic file writes) and ``load_bundle``
- ``batchtree`` a batch (nested tensors, dicts, lists, dataclasses) to and from CPU files;
                dataset indices when the loader exposes them
- ``rng``       every RNG state a step depends on (python, numpy, torch CPU and CUDA)
- ``inspect``   a bundle summarised for ``trainguard inspect``

The collective that writes a bundle during training needs the step's agreement, so it
lives on the step path (``trainguard.step.capturer``) and writes with this package's format
helpers. Offers: ``Bundle``, ``load_bundle``, ``inspect_bundle``, ``rng_state``,
``set_rng_state``. Imports only the shared base modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard.lazy_names import lazy_names

if TYPE_CHECKING:
    from trainguard.capture.bundle import Bundle, load_bundle
    from trainguard.capture.inspect import inspect_bundle
    from trainguard.capture.rng import rng_state, set_rng_state

__all__ = ["Bundle", "inspect_bundle", "load_bundle", "rng_state", "set_rng_state"]

_LAZY = {
    "Bundle": "trainguard.capture.bundle",
    "load_bundle": "trainguard.capture.bundle",
    "inspect_bundle": "trainguard.capture.inspect",
    "rng_state": "trainguard.capture.rng",
    "set_rng_state": "trainguard.capture.rng",
}
"""Where each name lives: imported on first use, so that reading a bundle's JSON (``trainguard
report``, ``capture/forward_inputs.py``) does not import torch."""


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
