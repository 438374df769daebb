"""Classic causes of a non-finite training step, as small cases with the expected diagnosis.

Each case builds ``(model, loss_fn, batch)`` whose step goes non-finite for one known reason
and says what a diagnosis should name: the ``phase`` (inputs, forward, loss, backward), the
``op`` (a substring of the aten op, or of the forward op whose gradient failed), the
``module``, the source ``line`` (marked ``# ROOT:<case>`` below), the culprit ``sample``
and trainguard's ``verdict``. Used by tests/unit/replay/test_diagnosis_*.py and by
benchmarks/diagnosis_suite.py (the tool comparison of docs/diagnosis.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BATCH, D = 8, 4
LossFn = Callable[[nn.Module, Any], Tensor]


def _x(seed: int = 0, positive: bool = False) -> Tensor:
    x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(seed))
    return x.abs() + 0.5 if positive else x


def _y() -> Tensor:
    return torch.arange(BATCH) % 3


class Net(nn.Module):
    """(``lead``: a linear map without bias, so that gradients reach ``pre``; an all-zero
    sample stays zero) -> ``pre`` (the module under test) -> ``fc`` -> 3 logits."""

    def __init__(self, pre: nn.Module, lead: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lead = nn.Linear(D, D, bias=False) if lead else nn.Identity()
        self.pre = pre
        self.fc = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc(self.pre(self.lead(x)))
        return out


def ce(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


# -- the modules and losses with the bugs ---------------------------------------------------


class Sharp(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 10.0


def log_of_probs(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    probs = torch.softmax(model(batch[0]), dim=-1)
    logp = torch.log(probs)  # ROOT:log_zero
    onehot = F.one_hot(batch[1], 3).float()
    return -(onehot * logp).sum(-1).mean()


def balanced(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    per_sample = F.cross_entropy(model(batch[0]), batch[1], reduction="none")
    sums = torch.zeros(3).index_add(0, batch[1], per_sample)
    counts = torch.bincount(batch[1], minlength=3).float()
    return (sums / counts).mean()  # ROOT:div_empty_count


class RowNorm(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x / x.norm(dim=-1, keepdim=True)  # ROOT:div_zero_norm


class Gamma(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.pow(1.5)  # ROOT:pow_negative


class RootScale(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sqrt(x.pow(2).sum(-1, keepdim=True))  # ROOT:sqrt_backward


class Angle(nn.Module):
    """The angle to the first axis: exactly 0 for a sample on that axis."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, x: Tensor) -> Tensor:
        x = x * self.scale
        cos = (x[:, :1] / x.norm(dim=-1, keepdim=True)).clamp(-1.0, 1.0)
        return x + torch.acos(cos)  # ROOT:acos_backward


class ManualSoftmax(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        e = torch.exp(x * 30.0)  # ROOT:exp_overflow
        return e / e.sum(-1, keepdim=True)


class HalfLinear(nn.Module):
    """A float16 layer (CPU: explicit .half(), as autocast would run it on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        nn.init.constant_(self.lin.weight, 1.0)

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.lin.weight.half(), self.lin.bias.half()
        return F.linear(x.half(), w, b).float()  # ROOT:fp16_overflow


class AutocastWide(nn.Module):
    """A linear layer with unit weights: float16 under autocast (the loss_fn enters it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        nn.init.constant_(self.lin.weight, 1.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x)  # ROOT:fp16_autocast


def ce_autocast(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The loop's ``with torch.autocast("cpu", dtype=torch.float16): loss = ...``."""
    with torch.autocast("cpu", dtype=torch.float16):
        return ce(model, batch)


class FeatureAttention(nn.Module):
    """Self-attention over a sample's features; a feature that is exactly 0 is padding."""

    def forward(self, x: Tensor) -> Tensor:
        scores = x[:, :, None] * x[:, None, :]
        scores = scores.masked_fill((x == 0)[:, None, :], float("-inf"))
        attn = torch.softmax(scores, dim=-1)  # ROOT:masked_row
        return (attn @ x[:, :, None]).squeeze(-1)


class Softplus(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(1 + torch.exp(x * 20.0))  # ROOT:softplus


class Identity(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


class SafeSqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        root = torch.sqrt(x.clamp_min(0.0))
        ctx.save_for_backward(root)
        return root

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (root,) = ctx.saved_tensors
        return grad / (2 * root)  # ROOT:custom_function


class CustomRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = SafeSqrt.apply(x * self.scale)
        return out


# -- the cases --------------------------------------------------------------------------------


@dataclass
class NanCase:
    name: str
    description: str
    build: Callable[[], tuple[nn.Module, LossFn, Any]]
    phase: str | None
    op: str | None
    """A substring of the op to name (None: no op is the cause)."""
    module: str | None
    line: bool
    """Whether a source line is expected (the ``# ROOT:<name>`` line)."""
    sample: int | None
    verdict: str
    history: list[dict[str, Any]] | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _with_sample(x: Tensor, position: int, value: Any) -> Tensor:
    x = x.clone()
    x[position] = value
    return x


def _case_log_zero() -> tuple[nn.Module, LossFn, Any]:
    x = _with_sample(_x(1), 3, torch.tensor([40.0, -40.0, 40.0, -40.0]))
    return Net(Sharp()), log_of_probs, (x, _y())


def _case_div_empty_count() -> tuple[nn.Module, LossFn, Any]:
    y = _y()
    return Net(Identity()), balanced, (_x(2), torch.where(y == 2, torch.zeros_like(y), y))


def _case_div_zero_norm() -> tuple[nn.Module, LossFn, Any]:
    return Net(RowNorm()), ce, (_with_sample(_x(3), 5, 0.0), _y())


def _case_pow_negative() -> tuple[nn.Module, LossFn, Any]:
    return Net(Gamma()), ce, (_with_sample(_x(4, positive=True), 2, -1.0), _y())


def _case_sqrt_backward() -> tuple[nn.Module, LossFn, Any]:
    return Net(RootScale(), lead=True), ce, (_with_sample(_x(5), 6, 0.0), _y())


def _case_acos_backward() -> tuple[nn.Module, LossFn, Any]:
    sample = torch.tensor([2.0, 0.0, 0.0, 0.0])
    return Net(Angle()), ce, (_with_sample(_x(6), 1, sample), _y())


def _case_exp_overflow() -> tuple[nn.Module, LossFn, Any]:
    return Net(ManualSoftmax()), ce, (_with_sample(_x(7), 4, 5.0), _y())


def _case_fp16_overflow() -> tuple[nn.Module, LossFn, Any]:
    return Net(HalfLinear()), ce, (_with_sample(_x(8), 0, 2.0e4), _y())


def _case_fp16_autocast() -> tuple[nn.Module, LossFn, Any]:
    return Net(AutocastWide()), ce_autocast, (_with_sample(_x(14), 0, 2.0e4), _y())


def _case_masked_row() -> tuple[nn.Module, LossFn, Any]:
    return Net(FeatureAttention()), ce, (_with_sample(_x(15), 6, 0.0), _y())


def _case_softplus() -> tuple[nn.Module, LossFn, Any]:
    return Net(Softplus()), ce, (_with_sample(_x(9), 7, 10.0), _y())


def _case_bad_weights() -> tuple[nn.Module, LossFn, Any]:
    model = Net(Identity())
    with torch.no_grad():
        model.fc.weight[1, 2] = float("nan")
    return model, ce, (_x(10), _y())


def _case_bad_input() -> tuple[nn.Module, LossFn, Any]:
    return Net(Identity()), ce, (_with_sample(_x(11), 4, float("nan")), _y())


def _case_custom_function() -> tuple[nn.Module, LossFn, Any]:
    x = _x(12, positive=True)
    x[3, 1] = 0.0
    return Net(CustomRoot()), ce, (x, _y())


def diverging_run(
    steps: int = 40, lr: float = 0.6
) -> tuple[nn.Module, LossFn, Any, list[dict[str, Any]]]:
    """A linear regression trained with too high a learning rate, until its loss overflows.

    Returns the model before the bad step, the loss, the bad step's batch and the history
    (as a bundle's ``history.json`` records: the bad step last)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 1))
    gen = torch.Generator().manual_seed(13)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    history: list[dict[str, Any]] = []
    for step in range(steps * 50):
        x = torch.randn(BATCH, D, generator=gen) * 3
        batch = (x, x.sum(-1, keepdim=True))
        loss = mse(model, batch)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        finite = torch.isfinite(loss).item() and norm == norm and norm != float("inf")
        history.append(
            {
                "step": step,
                "losses": [loss.item()],
                "grad_norm": norm,
                "decision": "ok" if finite else "skip",
                "lr": lr,
            }
        )
        if not finite:
            model.zero_grad()
            return model, mse, batch, history[-steps:]
        optimizer.step()
    raise RuntimeError("the run did not diverge")


def mse(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return ((model(batch[0]) - batch[1]) ** 2).mean()  # ROOT:divergence


def _case_divergence() -> tuple[nn.Module, LossFn, Any]:
    model, loss_fn, batch, _ = diverging_run()
    return model, loss_fn, batch


CASES = [
    NanCase(
        "log_zero",
        "log of a probability that underflowed to 0, then 0 * -inf in a hand-written NLL",
        _case_log_zero,
        "loss",
        "log",
        None,
        True,
        3,
        "numerical",
    ),
    NanCase(
        "div_empty_count",
        "a per-class mean divided by the count of a class the batch lacks",
        _case_div_empty_count,
        "loss",
        "div",
        None,
        True,
        None,
        "batch_statistics",
    ),
    NanCase(
        "div_zero_norm",
        "a row divided by its norm, for an all-zero sample",
        _case_div_zero_norm,
        "forward",
        "div",
        "pre",
        True,
        5,
        "numerical",
    ),
    NanCase(
        "pow_negative",
        "a fractional power of a negative number",
        _case_pow_negative,
        "forward",
        "pow",
        "pre",
        True,
        2,
        "numerical",
    ),
    NanCase(
        "sqrt_backward",
        "sqrt at 0: finite forward, 0/0 in its gradient",
        _case_sqrt_backward,
        "backward",
        "sqrt",
        "pre",
        True,
        6,
        "numerical",
    ),
    NanCase(
        "acos_backward",
        "acos of a cosine of exactly 1: finite forward, -inf gradient",
        _case_acos_backward,
        "backward",
        "acos",
        "pre",
        True,
        1,
        "numerical",
    ),
    NanCase(
        "exp_overflow",
        "exp overflow in a hand-written softmax (inf / inf)",
        _case_exp_overflow,
        "forward",
        "exp",
        "pre",
        True,
        4,
        "numerical",
    ),
    NanCase(
        "fp16_overflow",
        "a float16 linear layer overflows 65504",
        _case_fp16_overflow,
        "forward",
        "addmm",
        "pre",
        True,
        0,
        "overflow_fp16",
        notes="explicit .half() ops (CPU autocast also runs linear in float16 in torch 2.13, "
        "but a GPU is where this usually happens)",
    ),
    NanCase(
        "fp16_autocast",
        "a linear layer overflows 65504 under the loop's CPU float16 autocast",
        _case_fp16_autocast,
        "forward",
        "addmm",
        "pre.lin",
        True,
        0,
        "overflow_fp16",
    ),
    NanCase(
        "masked_row",
        "softmax of a row the padding mask covers entirely (a sample with no valid feature)",
        _case_masked_row,
        "forward",
        "_softmax",
        "pre",
        True,
        6,
        "masked_row",
    ),
    NanCase(
        "softplus",
        "a hand-written softplus log(1 + exp(x)) overflows",
        _case_softplus,
        "forward",
        "exp",
        "pre",
        True,
        7,
        "numerical",
    ),
    NanCase(
        "bad_weights",
        "a weight is already NaN before the step",
        _case_bad_weights,
        "forward",
        None,
        "fc",
        False,
        None,
        "nonfinite_weights",
    ),
    NanCase(
        "divergence",
        "too high a learning rate: the loss grows until it overflows",
        _case_divergence,
        "loss",
        None,
        None,
        False,
        None,
        "divergence",
    ),
    NanCase(
        "bad_input",
        "the batch holds a NaN",
        _case_bad_input,
        "inputs",
        None,
        None,
        False,
        4,
        "bad_input",
    ),
    NanCase(
        "custom_function",
        "a custom autograd Function whose backward divides by sqrt(0)",
        _case_custom_function,
        "backward",
        "div",
        "pre",
        True,
        3,
        "numerical",
    ),
]
BY_NAME = {case.name: case for case in CASES}


def root_line(name: str) -> int:
    """The line number of the ``# ROOT:<name>`` marker in this file."""
    with open(__file__, encoding="utf-8") as source:
        for number, text in enumerate(source, 1):
            if f"# ROOT:{name}" in text and "NanCase(" not in text and "def root_line" not in text:
                return number
    raise KeyError(name)
