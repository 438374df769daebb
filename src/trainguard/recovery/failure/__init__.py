"""The state at a failure: a lost rank costs the step in flight, not the work since the last
checkpoint (docs/recovery.md, "State at a failure").

- ``boundary`` the step in flight as this rank knows it, and whether its state is still the
  step's start (the proof a state at a failure needs)
- ``store``    the per-job folder on fast local storage (``/dev/shm``), its files, cleanup
- ``mirror``   each rank's step-start record (RNG states, data position), rewritten each step:
  what a rank that dies without a word leaves for its restart
- ``writer``   a survivor's state at the start of the step in flight, written atomically
  within a bounded time, once
- ``on_terminate`` the launcher's SIGTERM: the state is written from a thread, also while the
  main thread is blocked inside a collective
- ``shards``   sharded state (FSDP2): each rank's snapshot shard kept on the next rank too
- ``fresh``    resume from the freshest state every rank can be given, agreed
- ``part``     ``FailureState``: what recovery composes

Imports the base modules and ``capture`` only, never the step path.
"""
