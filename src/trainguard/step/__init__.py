"""The per-step path: what runs inside the training loop on every rank.

``Guard`` composes the parts of a step; each lives in its own module:

- ``data``      ``BatchStream`` behind ``guard.watch()``: prefetch, uneven-data agreement
- ``detect``    the local checks: the loss and one fused pass over the gradients
- ``consensus`` the one small all-reduce every rank reads the same way (``Agreement``)
- ``collective_work`` keeps the latest collective's work so gloo's thread never releases its tensor
- ``policy``    the decision for a step (``Decision``), from agreed data only
- ``deferred``  the sync-free mechanism: ``found_inf`` on the device, the host stager
- ``syncfree``  the sync-free ``guard.step()``: one step on the device, read a step late
- ``nonfinite`` a bad step's ``nonfinite`` event, and the error that stops the run
- ``amp``       fp16 with a GradScaler: unscale before the check, equal scales on every rank
- ``state``     ``GuardState``: the counters every rank keeps identically
- ``capturer``  the collective write of a capture bundle on a bad step (the format and the
                reading live in ``trainguard.capture``)
- ``history``   the per-step record and the ring of recent steps (``history.json`` in bundles)
- ``metrics``   rank 0's batched, thinned per-step log ``run_dir/metrics/rank-0.jsonl``
- ``spikes``    the loss / grad-norm spike rule (log-space EMA, z-score and ratio floor)
- ``spikewatch`` the rule in the step: judged on the host, or on the device for ``found_inf``
- ``inputs``    the fused finiteness check of the batch's floating inputs
- ``sampler``   the ``DistributedSampler.set_epoch`` check at each ``watch()``
- ``manual``    ``record_batch()``: the capture's batches for loops without ``watch()``

Offers to the rest: ``Guard``, ``GuardState``, ``Decision``, ``named_parameters``.
The step path may import ``capture``, ``hang`` and the shared base modules; nothing below it
imports the step path.
"""

from trainguard.step.detect import named_parameters
from trainguard.step.guard import Guard
from trainguard.step.state import GuardState
from trainguard.step.types import Decision

__all__ = ["Decision", "Guard", "GuardState", "named_parameters"]
