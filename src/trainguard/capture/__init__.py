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

from trainguard.capture.bundle import Bundle, load_bundle
from trainguard.capture.inspect import inspect_bundle
from trainguard.capture.rng import rng_state, set_rng_state

__all__ = ["Bundle", "inspect_bundle", "load_bundle", "rng_state", "set_rng_state"]
