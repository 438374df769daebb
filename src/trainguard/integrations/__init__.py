"""Guards for loops a framework owns: PyTorch Lightning and the Hugging Face Trainer.

Offers (each imported lazily: ``import trainguard`` never imports lightning/transformers):

- ``trainguard.integrations.lightning.TrainGuard``: a ``lightning.pytorch.Callback``, and
  ``replay_spec(module)`` for ``trainguard replay --factory`` (extra ``trainguard[lightning]``);
- ``trainguard.integrations.transformers.TrainGuardCallback`` with ``TrainGuardMixin`` (the
  Trainer hooks that see the loss and the batches), and ``replay_spec(model)`` (extra
  ``trainguard[transformers]``);
- ``trainguard.integrations.tensorboard.TensorBoardLogger``: ``guard.metrics()`` as scalars and
  the guard's notable events as text (extra ``trainguard[tensorboard]``).

Both run the same ``Guard`` as a hand-written loop: the loss and the batches are handed over
with ``guard.record_loss`` / ``guard.record_batch``, and ``guard.check()`` runs once per
optimizer step on the accumulated, reduced, unscaled gradients (one fused pass, one
all-reduce). ``rerun=True`` reruns a bad step in place through the framework's own step
(its DDP wrapper, its backward, its no_sync: ``rerun.py``). The integrations import ``step``
and the shared base only.
"""
