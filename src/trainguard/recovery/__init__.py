"""Keeping a run alive: known-good snapshots and checkpoints, rollback, resume (docs/recovery.md).

- ``snapshot``   in-memory CPU snapshots at a step boundary; good after ``good_after`` steps
- ``checkpoint`` known-good checkpoints on disk (torch.distributed.checkpoint), retention
- ``resume``     the newest good checkpoint, agreed by every rank
- ``target``     the rollback target: a good snapshot, or a good checkpoint on disk
- ``backoff``    the LR factor on the schedule, applied around ``optimizer.step()``
- ``ladder``     the escalation rungs (rollback, + LR backoff, + moment reset, stop)
- ``ledger``     the persisted skip ledger (batch positions, dataset indices), each once
- ``first_loss`` the first loss after a rollback or resume against the saved one
- ``stop``       the stop record (``run_dir/stop.json``) the guard's final stop writes
- ``restart``    a restart into the same stop with nothing changed is refused (exit 93)
- ``manager``    ``Recovery``: the part the guard composes (``types``: what it passes around)
- ``build``      ``build_recovery`` (when an option is on) and the final stop record

Offers: ``Recovery``, ``build_recovery``, ``recovery_enabled``, ``record_final_stop``,
``TrainingObjects``.
Imports the base modules and ``capture`` only, never the step path.
"""

from trainguard.recovery.build import build_recovery, record_final_stop, recovery_enabled
from trainguard.recovery.manager import Recovery
from trainguard.recovery.snapshot import TrainingObjects

__all__ = ["Recovery", "TrainingObjects", "build_recovery", "record_final_stop", "recovery_enabled"]
