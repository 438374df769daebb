"""Replay: re-run a captured step anywhere and say what went wrong.

- ``runner``    ``replay()``: rebuild the model, load the bundle, re-run, diagnose
- ``factory``   ``--factory MODULE:FUNC``: imported and called as a script would run them
- ``origin``    which rank made the non-finite values, which only received them
- ``autocast``  the autocast state the step ran under, re-entered on the replay's device
- ``replicas``  replicated parameters that differ across the bundle's ranks
- ``explain``   what a multi-rank or finite replay says beyond the diagnosis
- ``trace``     ``trace()`` / ``diagnose()``: the same diagnosis on live objects
- ``engine``    runs -> report, shared by both
- ``stepper``   one forward/loss/backward of the captured micro-batches
- ``localize``  the tracer: root op, NaN-maker, the hops between them and the loss
- ``masks``     mask values written on purpose; reductions over fully masked rows
- ``sites``     module stack and the user's source line; ``seeds``: pre-step non-finite
- ``chain``     the path and the roots as plain data
- ``bisect``    the culprit samples
- ``diagnosis`` phase, root and summary sentence; ``verdicts``: the class and its advice
- ``report``    ``ReplayReport`` and its ``KEYS``
- ``render``    text for the CLI (inspect, replay, demo)

Offers: ``replay``, ``ReplayReport``, ``ReplaySpec``, ``trace``, ``diagnose``. Reads bundles through
``trainguard.capture``; never imports the step path or the watchdog.

Note: ``trainguard.replay`` (the attribute of the top-level package) is the *function*
``replay``; import this package's modules by their full name
(``from trainguard.replay.runner import ...``).
"""

from trainguard.replay.runner import ReplayReport, ReplaySpec, replay
from trainguard.replay.trace import Trace, diagnose, trace

__all__ = ["ReplayReport", "ReplaySpec", "Trace", "diagnose", "replay", "trace"]
