"""Cross-rank health, fed by numbers the step already agrees on (docs/health.md).

- ``timing``     per rank and step: time waiting for data, time of its own compute
- ``stragglers`` the rule that names a rank slowing the job (``straggler`` events)
- ``replicas``   replica agreement: a fingerprint of the replicated weights rides the step's
                 agreement; a divergence is reported, resynced or raised
- ``resync``     every replica takes one rank's weights, buffers and optimizer state
- ``learning_rates`` every rank's LR rides the agreement: ``lr_mismatch`` when they differ

Offers: ``StepTimer``, ``StragglerWatch``, ``ReplicaWatch``, ``LrAgreement``. Imports the
base modules only, never the step path: the guard hands the agreed numbers in.
"""
