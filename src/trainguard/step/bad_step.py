"""What a capture knows of a bad step (``BadStep``) and what a rank's ``meta.json`` says of it
(``rank_meta``): the losses, the gradient norms, the micro-batches and their dataset indices,
the RNG states, the environment. Built on bad steps only (host reads); written by the capturer
(``capturer.Capturer``)."""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainguard.capture import batchtree
from trainguard.numerics import norm_or_inf
from trainguard.step.detect import GradStats
from trainguard.step.types import Agreement, Decision


@dataclass
class BadStep:
    """What the guard knows about a bad step when it captures it."""

    step: int
    decision: Decision
    agreement: Agreement
    bad_params: list[str]
    """This rank's parameters whose gradients are not finite."""
    param_grad_norms: dict[str, float]
    local_grad_norm: float
    micro_losses: list[float]
    micro_batches: list[Any] | None
    """The step's micro-batches (references), or None when the loop did not use watch()."""
    rng: dict[str, Any] | None
    """RNG states taken before the step's first micro-batch."""
    reason: str = "first_bad_step"
    spike: bool = False
    """A finite step the spike rule skipped or escalated (its manifest's trigger: ``spike``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    history: dict[str, Any] | None = None
    """The recent steps (``StepHistory.bundle_history``): rank 0 writes it as history.json."""
    buffers: dict[str, Tensor] = field(default_factory=dict)
    """Buffers the step's forward changed, as they were before it (state-dict names): the
    bundle's weights start from the step's real start (``buffers.BufferKeeper.pre_step``)."""
    factory_config: dict[str, Any] = field(default_factory=dict)
    """``GuardConfig.factory_config``: the manifest's, for the replay factory."""
    sampler_indices: list[list[int] | None] | None = None
    """Per micro-batch, the dataset indices the ``DataLoader``'s sampler drew for it
    (``capture/sampler_indices.py``): ``meta.json``'s ``dataset_indices`` where the batch
    carries none of its own."""


def bad_step_of(
    step: int,
    decision: Decision,
    agreement: Agreement,
    stats: GradStats,
    micro_batches: list[Any],
    rng: dict[str, Any] | None,
    micro_losses: list[Tensor],
) -> BadStep:
    """Collect the evidence of a bad step (host reads: bad steps only)."""
    norms = stats.norms.tolist() if stats.norms is not None else []
    return BadStep(
        step=step,
        decision=decision,
        agreement=agreement,
        bad_params=stats.bad_names(),
        param_grad_norms=dict(zip(stats.names, norms, strict=True)),
        local_grad_norm=norm_or_inf(float(stats.norm)),
        micro_losses=[float(loss.float().mean()) for loss in micro_losses],
        micro_batches=list(micro_batches) if micro_batches else None,
        rng=rng,
        reason="escalation" if decision is Decision.ESCALATE else "first_bad_step",
    )


def rank_meta(rank: int, model: nn.Module, evidence: BadStep) -> dict[str, Any]:
    agreement = evidence.agreement
    micro = evidence.micro_batches
    indices = [batchtree.dataset_indices(b) for b in micro] if micro is not None else None
    drawn = evidence.sampler_indices
    if indices is not None and drawn is not None and len(drawn) == len(indices):
        indices = [
            own if own is not None else by_sampler
            for own, by_sampler in zip(indices, drawn, strict=True)
        ]
    return {
        "rank": rank,
        "step": evidence.step,
        "loss": agreement.losses[rank],
        "micro_losses": evidence.micro_losses,
        "loss_finite": rank not in agreement.loss_ranks,
        "grad_finite": rank not in agreement.grad_ranks,
        "local_grad_norm": evidence.local_grad_norm,
        "grad_norm": agreement.grad_norm,
        "nonfinite_params": evidence.bad_params,
        "param_grad_norms": evidence.param_grad_norms,
        "batch_stored": micro is not None,
        "micro_batches": len(micro) if micro is not None else 0,
        "dataset_indices": indices if indices and any(i is not None for i in indices) else None,
        "rng_stored": evidence.rng is not None,
        "model_class": batchtree.type_name(model),
        "model_training": model.training,
        "env": environment(rank, model),
        **evidence.extra,
    }


def environment(rank: int, model: nn.Module) -> dict[str, Any]:
    device = next((str(p.device) for p in model.parameters()), "cpu")
    env: dict[str, Any] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backend": str(dist.get_backend())
        if dist.is_available() and dist.is_initialized()
        else None,
    }
    if torch.cuda.is_available() and device.startswith("cuda"):
        env["cuda_device"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
    return env
