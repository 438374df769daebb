"""Replay: re-run a captured step anywhere and say what went wrong.

- ``runner``    ``replay()``: rebuild the model, load the bundle, re-run, diagnose
- ``stepper``   one forward/loss/backward of the captured micro-batches
- ``localize``  the tracer: first non-finite op, its module and source line
- ``bisect``    the culprit samples
- ``diagnosis`` verdict and summary from what the runs found
- ``render``    text for the CLI (inspect, replay, demo)

Offers: ``replay``, ``ReplayReport``, ``ReplaySpec``. Reads bundles through
``trainguard.capture``; never imports the step path or the watchdog.

Note: ``trainguard.replay`` (the attribute of the top-level package) is the *function*
``replay``; import this package's modules by their full name
(``from trainguard.replay.runner import ...``).
"""

from trainguard.replay.runner import ReplayReport, ReplaySpec, replay

__all__ = ["ReplayReport", "ReplaySpec", "replay"]
