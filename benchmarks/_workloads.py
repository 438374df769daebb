"""The models the benchmarks train: plain torch, no trainguard.

- ``mlp``: a stack of Linear + ReLU, parameter-heavy (little compute per weight, so a pass
  over the gradients shows);
- ``transformer``: a small GPT-style model (``TinyGPT``), compute-heavy, like a real step;
- ``bnconv``: a small conv net with BatchNorm, whose forward writes its running statistics
  every step (what the guard's buffer restore copies).

Sizes (``SIZES``): ``quick`` (a smoke run, milliseconds a step), ``cpu`` (0.1-1 s a step on
2 cores), ``gpu`` (tens of milliseconds a step on an H100).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Batch = tuple[Tensor, Tensor]


class MLPStack(nn.Module):
    """``layers`` x (Linear(width, width) + ReLU)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
        )

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.layers(x)
        return out


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        out: Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class TinyGPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final norm, untied LM head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        out: Tensor = self.head(self.ln(self.blocks(self.tok(tokens) + self.pos(pos))))
        return out


class BNConv(nn.Module):
    """Three Conv2d + BatchNorm2d + ReLU blocks, pooled, a linear head."""

    def __init__(self, width: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for _ in range(3):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.body(x).mean((2, 3)))
        return out


@dataclass(frozen=True)
class Workload:
    name: str
    sizes: dict[str, int]
    lr: float
    clip_norm: float
    """``max_norm`` of the clip modes: below the usual gradient norm, so clipping happens."""

    @property
    def description(self) -> str:
        s = self.sizes
        if self.name == "mlp":
            width = s["width"]
            return f"MLP {s['layers']} x Linear({width}, {width}) + ReLU, batch {s['batch']}, MSE"
        if self.name == "transformer":
            return (
                f"GPT-style, vocab {s['vocab']}, dim {s['dim']}, {s['layers']} layers, "
                f"{s['heads']} heads, seq {s['seq']}, batch {s['batch']}, cross-entropy"
            )
        return (
            f"3 x (Conv2d({s['width']}) + BatchNorm2d + ReLU), {s['batch']} images of "
            f"3 x {s['image']} x {s['image']}, cross-entropy"
        )

    def build(self) -> nn.Module:
        s = self.sizes
        if self.name == "mlp":
            return MLPStack(s["width"], s["layers"])
        if self.name == "transformer":
            return TinyGPT(s["vocab"], s["dim"], s["layers"], s["heads"], s["seq"])
        return BNConv(s["width"])

    def batch(self, gen: torch.Generator) -> Batch:
        s = self.sizes
        if self.name == "mlp":
            shape = (s["batch"], s["width"])
            return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        if self.name == "transformer":
            tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=gen)
            return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        images = torch.randn(s["batch"], 3, s["image"], s["image"], generator=gen)
        return images, torch.randint(0, 10, (s["batch"],), generator=gen)

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        inputs, targets = batch
        out = model(inputs)
        if self.name == "mlp":
            return F.mse_loss(out.float(), targets)
        if self.name == "transformer":
            return F.cross_entropy(out.flatten(0, 1).float(), targets.flatten())
        return F.cross_entropy(out.float(), targets)


SIZES: dict[str, dict[str, dict[str, int]]] = {
    "quick": {
        "mlp": {"width": 64, "layers": 3, "batch": 4},
        "transformer": {"vocab": 64, "dim": 32, "layers": 1, "heads": 2, "seq": 16, "batch": 2},
        "bnconv": {"width": 8, "batch": 4, "image": 8},
    },
    "cpu": {
        "mlp": {"width": 1448, "layers": 12, "batch": 16},
        "transformer": {"vocab": 4096, "dim": 256, "layers": 4, "heads": 4, "seq": 128, "batch": 8},
        "bnconv": {"width": 32, "batch": 32, "image": 32},
    },
    "gpu": {
        "mlp": {"width": 4096, "layers": 8, "batch": 512},
        "transformer": {
            "vocab": 32768,
            "dim": 1024,
            "layers": 8,
            "heads": 16,
            "seq": 512,
            "batch": 16,
        },
        "bnconv": {"width": 128, "batch": 128, "image": 64},
    },
}
WORKLOADS = ("mlp", "transformer", "bnconv")
_TRAINING = {"mlp": (1e-4, 0.005), "transformer": (3e-4, 0.25), "bnconv": (1e-3, 0.5)}


def workload(name: str, sizes: str) -> Workload:
    lr, clip_norm = _TRAINING[name]
    return Workload(name, SIZES[sizes][name], lr, clip_norm)
