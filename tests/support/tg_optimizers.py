"""Optimizers of the tests that torch.optim does not have."""

from __future__ import annotations

from typing import Any

import torch


class Muon(torch.optim.Optimizer):
    """Momentum orthogonalized by Newton-Schulz iterations (the speedruns' form, shortened)."""

    def __init__(self, params: Any, lr: float = 0.02, momentum: float = 0.95) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()  # type: ignore[untyped-decorator]
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - group["momentum"])
                x = p.grad.lerp(buf, group["momentum"])
                x = x / (x.norm() + 1e-7)
                for _ in range(5):
                    a = x @ x.mT
                    x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
                p.add_(x, alpha=-group["lr"])
