"""Small Python objects between ranks, without NumPy.

torch's object collectives (``broadcast_object_list``, ``all_gather_object``) turn the bytes
they receive back into an object through ``Tensor.numpy()``: without NumPy installed (torch
does not require it) they fail with "Numpy is not available", and with them every guard of
more than one rank. These do the same with the guard's tensors and collectives only: the
object pickled into a ``uint8`` tensor (``torch.frombuffer``), its length exchanged first,
and the bytes read back with ``ctypes.string_at`` from a contiguous CPU copy. For the small
objects the guard exchanges (a run id, host names, a bundle's per-rank notes, an optimizer's
state layout); like torch's, they unpickle what the other ranks of the job send.
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch
import torch.distributed as dist


def _to_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    payload = bytearray(pickle.dumps(obj))
    return torch.frombuffer(payload, dtype=torch.uint8).to(device)


def _from_tensor(data: torch.Tensor, size: int) -> Any:
    host = data[:size].to("cpu").contiguous()
    return pickle.loads(ctypes.string_at(host.data_ptr(), size))


def broadcast_object(
    obj: Any, src: int, group: dist.ProcessGroup | None, device: torch.device
) -> Any:
    """``obj`` of global rank ``src``, on every rank of ``group`` (others pass anything)."""
    mine = dist.get_rank() == src
    data = _to_tensor(obj, device) if mine else torch.empty(0, dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    length = int(size.item())
    if not mine:
        data = torch.empty(length, dtype=torch.uint8, device=device)
    dist.broadcast(data, src, group=group)
    return obj if mine else _from_tensor(data, length)


def all_gather_objects(
    obj: Any, group: dist.ProcessGroup | None, device: torch.device
) -> list[Any]:
    """Every rank's ``obj``, in the group's rank order."""
    world = dist.get_world_size(group)
    data = _to_tensor(obj, device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    buffers = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(buffers, padded, group)
    return [_from_tensor(buf, n) for buf, n in zip(buffers, lengths, strict=True)]
