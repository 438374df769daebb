"""Models, data and replay factories for the capture/replay tests.

Each scenario makes a step non-finite in a known place:

- ``forward``: ``encoder.layers.0.norm`` divides a row by its norm; an all-zero sample gives
  an all-zero row (the layer's linear map has no bias) -> 0/0.
- ``loss``: a class-balanced loss divides per-class sums by per-class counts outside any
  module; a batch that lacks a class -> 0/0.
- ``backward``: ``encoder.layers.0.scale`` computes ``x * sqrt(sum(x**2))``: finite at an
  all-zero sample, but the gradient of ``sqrt`` at 0 is 0/0.
- ``inputs``: the batch itself holds NaN.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

D_IN = 6
CLASSES = 3
BATCH = 8


class RowNorm(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x / x.norm(dim=-1, keepdim=True)


class RootScale(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sqrt(x.pow(2).sum(dim=-1, keepdim=True))


class Layer(nn.Module):
    def __init__(self, pre: nn.Module | None = None) -> None:
        super().__init__()
        if isinstance(pre, RowNorm):
            self.norm = pre
        elif isinstance(pre, RootScale):
            self.scale = pre
        self.fc = nn.Linear(D_IN, D_IN, bias=False)  # an all-zero sample stays zero

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        for name in ("norm", "scale"):
            pre = getattr(self, name, None)
            if pre is not None:
                h = pre(h)
        return torch.tanh(h)


class Encoder(nn.Module):
    def __init__(self, pre: nn.Module | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(pre), Layer()])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Net(nn.Module):
    def __init__(self, pre: nn.Module | None = None) -> None:
        super().__init__()
        self.encoder = Encoder(pre)
        self.head = nn.Linear(D_IN, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.encoder(x))
        return out


def ce_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def balanced_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    per_sample = F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")
    sums = torch.zeros(CLASSES).index_add(0, batch["y"], per_sample)
    counts = torch.bincount(batch["y"], minlength=CLASSES).float()
    return (sums / counts).mean()


SCENARIOS: dict[str, tuple[Any, Any]] = {
    "forward": (RowNorm, ce_loss),
    "loss": (None, balanced_loss),
    "backward": (RootScale, ce_loss),
    "inputs": (None, ce_loss),
    "clean": (None, ce_loss),
}


def make_model(scenario: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    pre, _ = SCENARIOS[scenario]
    return Net(pre() if pre is not None else None)


def loss_of(scenario: str) -> Any:
    return SCENARIOS[scenario][1]


def batches(
    scenario: str, steps: int, bad_step: int, bad_pos: int = 5, seed: int = 0
) -> list[dict[str, Tensor]]:
    """``steps`` batches of dicts with ``x``, ``y`` and ``index``; one is bad at ``bad_step``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        x = torch.randn(BATCH, D_IN, generator=gen)
        y = torch.arange(BATCH) % CLASSES
        index = torch.arange(step * BATCH, (step + 1) * BATCH) + 1000
        if step == bad_step:
            if scenario in ("forward", "backward"):
                x[bad_pos] = 0.0
            elif scenario == "inputs":
                x[bad_pos, 2] = float("nan")
            elif scenario == "loss":
                y = torch.where(y == CLASSES - 1, torch.zeros_like(y), y)
        out.append({"x": x, "y": y, "index": index})
    return out


# -- replay factories (``--factory tg_capture_models:forward_factory``) ---------------------


def forward_factory() -> tuple[nn.Module, Any]:
    return make_model("forward", seed=99), ce_loss


def loss_factory() -> tuple[nn.Module, Any]:
    return make_model("loss", seed=99), balanced_loss


def backward_factory() -> tuple[nn.Module, Any]:
    return make_model("backward", seed=99), ce_loss


def clean_factory() -> tuple[nn.Module, Any]:
    return make_model("clean", seed=99), ce_loss


def wrong_return_factory() -> int:
    return 7


def wrong_model_factory() -> tuple[nn.Module, Any]:
    return nn.Linear(3, 3), ce_loss


def raising_factory() -> tuple[nn.Module, Any]:
    raise RuntimeError("cannot build the model")


def train(
    model: nn.Module,
    loss_fn: Any,
    data: list[Any],
    run_dir: Any,
    *,
    plan: Any = None,
    accumulation_steps: int = 1,
    **guard_kwargs: Any,
) -> Any:
    """A guarded SGD loop over ``data`` (micro-batches with accumulation); returns the guard."""
    import trainguard as tg

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = tg.Guard(
        model,
        optimizer,
        run_dir=run_dir,
        hang_timeout=0,
        accumulation_steps=accumulation_steps,
        **guard_kwargs,
    )
    with guard:
        for i, batch in enumerate(guard.watch(data)):
            step = guard.state.step
            loss = loss_fn(model, batch) / accumulation_steps
            if plan is not None:
                loss = plan.loss(loss, step)
            loss.backward()
            if (i + 1) % accumulation_steps:
                guard.record_loss(loss)
                continue
            if plan is not None:
                plan.grads(model, step)
            if guard.check(loss):
                optimizer.step()
            optimizer.zero_grad()
    return guard
