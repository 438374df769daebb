"""An unmodified script whose model takes an additive causal mask (0 and -inf) as its second
argument, for ``trainguard run``'s input options (tests/cli/test_run_inputs.py)."""

import torch
from torch import Tensor, nn


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.o = nn.Linear(8, 1)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        scores = self.q(x) @ x.transpose(1, 2) / 8**0.5 + mask
        out: Tensor = self.o(scores.softmax(-1) @ x).mean()
        return out


torch.manual_seed(0)
model = Attention()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
mask = torch.zeros(4, 4).masked_fill(causal, float("-inf"))
for _ in range(12):
    loss = model(torch.randn(2, 4, 8), mask).pow(2)
    loss.backward()
    opt.step()
    opt.zero_grad()
assert all(torch.isfinite(p).all() for p in model.parameters())
