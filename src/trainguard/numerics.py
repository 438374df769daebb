"""Numbers as trainguard reports them, shared by every part (step, capture, replay, report)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def norm_or_inf(norm: float) -> float:
    """A gradient norm as reported: NaN (a NaN gradient) becomes Inf, so a bad norm reads one
    way in events, bundles and replays."""
    return norm if math.isfinite(norm) else math.inf


_SPARSE_LAYOUTS = (
    torch.sparse_coo,
    torch.sparse_csr,
    torch.sparse_csc,
    torch.sparse_bsr,
    torch.sparse_bsc,
)


def is_sparse(tensor: Tensor) -> bool:
    """A sparse layout: COO (``nn.Embedding(sparse=True)``), CSR, CSC, BSR or BSC."""
    return tensor.layout in _SPARSE_LAYOUTS


def coalesced(tensor: Tensor) -> Tensor:
    """A sparse tensor of any layout as a detached, coalesced COO tensor: its stored values
    (``values()``) and their dense indices (``indices()``), never densified."""
    coo = tensor if tensor.layout == torch.sparse_coo else tensor.to_sparse()
    return coo.detach().coalesce()


def stored_values(tensor: Tensor) -> Tensor:
    """A strided tensor holding what ``tensor`` stores: itself when strided; a sparse tensor's
    specified values (a COO tensor coalesced first: duplicate indices summed, as in its dense
    form), so their norm and their largest ``|x|`` are those of the dense tensor."""
    if tensor.layout == torch.strided:
        return tensor
    if tensor.layout == torch.sparse_coo:
        return tensor.coalesce().values()
    if is_sparse(tensor):
        return tensor.values()
    return tensor.to_dense()


def is_additive_mask(tensor: Tensor) -> bool:
    """Every value is 0 or -inf, and some is -inf: an additive attention / padding mask
    (``scores + mask``) carried in a batch on purpose, not broken data (a host read). Stricter
    than a mask *buffer*'s rule (``replay/seeds._is_mask``: every non-finite value -inf): a
    feature tensor with a ``log(0)`` among real values is data, not a mask."""
    if not tensor.is_floating_point() or is_sparse(tensor) or not tensor.numel():
        return False
    data = tensor.detach()
    ninf = data == float("-inf")
    return bool(ninf.any()) and bool((ninf | (data == 0)).all())
