"""A recommender-style model with a sparse gradient, and torch's clipping as the reference.

``SparseNet``: ``nn.Embedding(sparse=True)`` (a sparse COO gradient, uncoalesced when a
batch repeats an index) under a dense head. Batches repeat indices on purpose, so a norm
taken over the uncoalesced values would differ from the dense gradient's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

VOCAB = 40
DIM = 6


class SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.head = nn.Linear(DIM, 1)

    def forward(self, idx: Tensor) -> Tensor:
        out: Tensor = self.head(self.emb(idx).mean(dim=1)).squeeze(-1)
        return out


def make_batches(n: int, seed: int, batch: int = 8, width: int = 5) -> list[Tensor]:
    """Index batches; every batch repeats index 0 (duplicate rows in the sparse gradient)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        idx = torch.randint(0, VOCAB, (batch, width), generator=gen)
        idx[:, 0] = 0
        batches.append(idx)
    return batches


def loss_fn(model: nn.Module, idx: Tensor) -> Tensor:
    target = (idx.float().mean(dim=1) / VOCAB) - 0.5
    out: Tensor = (model(idx) - target).pow(2).mean()
    return out


def optimizer(model: SparseNet, kind: str) -> torch.optim.Optimizer:
    """``sgd``: every parameter; ``sparse_adam``: the embedding alone (head frozen), since
    SparseAdam takes sparse gradients only."""
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5)
    model.head.requires_grad_(False)
    return torch.optim.SparseAdam([model.emb.weight], lr=0.05)


def dense_grads(model: nn.Module) -> dict[str, Tensor]:
    """Every gradient as a dense copy (a sparse one via ``to_dense()``)."""
    return {
        name: p.grad.to_dense().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def torch_clipped(grads: dict[str, Tensor], max_norm: float) -> dict[str, Tensor]:
    """What ``torch.nn.utils.clip_grad_norm_`` makes of these gradients, on copies.

    The gradients are dense copies: torch >= 2.0's clip_grad_norm_ raises on a sparse
    gradient itself (``_foreach_norm`` has no sparse kernel), and a dense copy has the same
    norm and clipped values as the sparse gradient it densifies."""
    holders = []
    for grad in grads.values():
        holder = torch.zeros_like(grad)
        holder.grad = grad.clone()
        holders.append(holder)
    torch.nn.utils.clip_grad_norm_(holders, max_norm)
    return {name: h.grad for name, h in zip(grads, holders, strict=True) if h.grad is not None}


def flat_params(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
