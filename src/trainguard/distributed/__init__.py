"""torch.distributed plumbing the guard's parts share.

- ``elastic``   what a torchrun (torchelastic) worker can tell from its environment: the
                restart count, the shared-store hazard, stopping the agent
- ``objects``   small Python objects between ranks without NumPy (torch's object
                collectives need it)
- ``world``     this process's rank and the job's size (0 and 1 without a process group)

Offers (by module): ``restart_count``, ``agree_attempt``, ``stop_agent`` (``elastic``);
``broadcast_object``, ``all_gather_objects`` (``objects``); ``rank``, ``world_size``
(``world``). Base plumbing: imports nothing
of the guard's parts.
"""
