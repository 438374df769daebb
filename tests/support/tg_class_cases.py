"""Guarded runs for issue 55's classes of non-finite steps: values that were already
non-finite, or came from outside the traced graph, or a deliberate -inf read where it must
not be. Each builds its own model, data and loop; each has a replay factory.

- class 1a, ``group_warmup_run``: two param groups; group 1 (the head, unfrozen at step 3)
  warms up over a length computed as 0, so its learning rate at step 3 is 0/0 = nan. The
  guard stops step 3 (trigger ``hyperparameter``); a loop run with ``on_nonfinite="warn"``
  that steps anyway lets that update write NaN into the head, and step 4's forward fails
  (the escalation's bundle).
- class 1b, ``grown_table_run``: a position table grown from 8 to 16 rows by copying chunks;
  the tail was never initialised (NaN here, whatever ``torch.empty`` left). Only a sequence
  longer than 8 reads it: the samples ``long`` at step ``bad_step``.
- class 2, ``class_weight_run``: ``nn.CrossEntropyLoss(weight=...)`` with class weights
  estimated on a sample of labels that lacked class 3 (``n / (k * 0) = inf``); a batch with a
  sample of class 3 makes the weighted mean inf / inf.
- class 3, ``schema_run``: logits masked to the tokens a schema allows at each position; one
  target (sample ``bad_sample``, a labelling bug) is a token the schema forbids there: the
  cross-entropy there is +inf. Gradient accumulation over 2 micro-batches.
- class 4, ``softmax_run``: a hand-written softmax (``exp / sum``, no max subtraction); an
  out-of-distribution sample overflows ``exp`` in a class the loss (the target's probability,
  ``log(p + eps)``) never reads: the loss is finite, the gradient NaN.
- class 5, ``InPlaceNorm``: a row divided in place by its sum of magnitudes (0/0 for an
  all-zero sample).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import trainguard as tg

BATCH = 8


def captures(run_dir: Path | str) -> list[Path]:
    return sorted((Path(run_dir) / "captures").glob("step-*"))


def guarded(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss_fn: Any,
    data: list[Any],
    run_dir: Path | str,
    *,
    accumulation: int = 1,
    after_step: Any = None,
    step_anyway: bool = False,
    **guard_kwargs: Any,
) -> tg.Guard:
    """A guarded loop over ``data`` (``accumulation`` micro-batches a step); ``step_anyway``:
    the loop steps the optimizer whatever ``check()`` says (with ``on_nonfinite="warn"``)."""
    guard = tg.Guard(
        model, opt, run_dir=run_dir, hang_timeout=0, accumulation_steps=accumulation, **guard_kwargs
    )
    try:
        with guard:
            for i, batch in enumerate(guard.watch(data)):
                loss = loss_fn(model, batch) / accumulation
                loss.backward()
                if (i + 1) % accumulation:
                    guard.record_loss(loss)
                    continue
                if guard.check(loss) or step_anyway:
                    opt.step()
                opt.zero_grad()
                if after_step is not None:
                    after_step()
    except tg.NonFiniteError:
        pass
    return guard


# -- class 1a: a param group's warm-up divides by zero ------------------------------------------


class TwoGroupNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.body(x)))  # type: ignore[no-any-return]


def xy_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def two_group_factory() -> tuple[nn.Module, Any]:
    return TwoGroupNet(), xy_loss


UNFREEZE = 3


def head_schedule(steps: int) -> Any:
    """The head's LR factor: 0 until ``UNFREEZE``, then a linear warm-up over a tenth of the
    steps left after it, computed with tensors: 0 steps here, so 0/0 = nan at ``UNFREEZE``."""
    warmup = (steps - UNFREEZE) // 10

    def factor(step: int) -> float:
        if step < UNFREEZE:
            return 0.0
        return float((torch.tensor(float(step - UNFREEZE)) / warmup).clamp(max=1.0))

    return factor


def group_warmup_run(run_dir: Path | str, steps: int = 8) -> list[Path]:
    """The guard with ``on_nonfinite="warn"``, a loop that steps anyway: the bundle of step
    ``UNFREEZE`` (its hyper-parameter) and the escalation's (non-finite head weights)."""
    model = TwoGroupNet()
    opt = torch.optim.Adam(
        [{"params": model.body.parameters()}, {"params": model.head.parameters()}], lr=1e-2
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, head_schedule(steps)])
    gen = torch.Generator().manual_seed(1)
    data = [
        {
            "x": torch.randn(BATCH, 6, generator=gen),
            "y": torch.randint(0, 3, (BATCH,), generator=gen),
            "index": torch.arange(BATCH) + BATCH * i,
        }
        for i in range(steps)
    ]
    guarded(
        model,
        opt,
        xy_loss,
        data,
        run_dir,
        after_step=sched.step,
        step_anyway=True,
        on_nonfinite="warn",
        max_consecutive=2,
    )
    return captures(run_dir)


# -- class 1b: rows of a grown table that only a long sequence reads --------------------------

VOCAB, WIDTH, OLD_ROWS, ROWS, SEQ = 20, 8, 8, 16, 12


class PositionNet(nn.Module):
    """Token and position embeddings, mean-pooled over each sequence's valid positions
    (padding positions read position 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(ROWS, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        steps = torch.arange(tokens.shape[1])
        valid = steps[None, :] < lengths[:, None]
        positions = steps[None, :].expand_as(tokens).masked_fill(~valid, 0)
        h = self.tok(tokens) + self.pos(positions)  # ROOT:grown_table_rows
        pooled = (h * valid[..., None]).sum(1) / lengths[:, None]
        return self.head(pooled)  # type: ignore[no-any-return]


def seq_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["tokens"], batch["lengths"]), batch["y"])


def position_factory() -> tuple[nn.Module, Any]:
    return PositionNet(), seq_loss


def grown(old: Tensor, rows: int, chunk: int = 4) -> Tensor:
    """``old`` grown to ``rows`` rows by copying it chunk by chunk into a new table; the
    tail is not initialised (NaN here: what ``torch.empty`` may leave)."""
    table = torch.empty(rows, old.shape[1])
    table[old.shape[0] :] = math.nan
    for start in range(0, old.shape[0], chunk):
        table[start : start + chunk] = old[start : start + chunk]
    return table


def sequences(
    steps: int, bad_step: int, long: tuple[int, ...], seed: int = 2
) -> list[dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        lengths = torch.randint(2, OLD_ROWS + 1, (BATCH,), generator=gen)
        if step == bad_step:
            lengths[list(long)] = SEQ
        out.append(
            {
                "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
                "lengths": lengths,
                "y": torch.randint(0, 3, (BATCH,), generator=gen),
                "index": torch.arange(BATCH) + 100 * seed + BATCH * step,
            }
        )
    return out


def grown_position_model() -> PositionNet:
    model = PositionNet()
    pretrained = torch.randn(OLD_ROWS, WIDTH, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model.pos.weight.copy_(grown(pretrained, ROWS))
    return model


def grown_table_run(
    run_dir: Path | str, long: tuple[int, ...] = (5,), bad_step: int = 3
) -> list[Path]:
    """Adam over a model whose position table was grown; ``long``: the samples of step
    ``bad_step`` that are longer than the table's initialised rows."""
    model = grown_position_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guarded(model, opt, seq_loss, sequences(5, bad_step, long), run_dir)
    return captures(run_dir)


# -- class 2: class weights estimated on a sample that lacked a class --------------------------

CLASSES = 4


def class_weights(labels: Tensor) -> Tensor:
    """Inverse-frequency class weights: ``n / (k * count)``; a class with no label gets inf."""
    counts = torch.bincount(labels, minlength=CLASSES).float()
    return labels.numel() / (CLASSES * counts)


ESTIMATION_LABELS = torch.tensor([0, 1, 2, 1, 0, 2, 2, 1, 0, 0])
"""The labels the weights were estimated on: class 3 is absent."""


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, CLASSES))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def weighted_factory() -> tuple[nn.Module, Any]:
    criterion = nn.CrossEntropyLoss(weight=class_weights(ESTIMATION_LABELS))

    def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        loss: Tensor = criterion(model(batch["x"]), batch["y"])  # ROOT:class_weights
        return loss

    return Classifier(), loss_fn


def class_weight_run(run_dir: Path | str, rare: int = 6, bad_step: int = 2) -> list[Path]:
    """Batches of classes 0-2, except the sample ``rare`` of step ``bad_step``: class 3."""
    model, loss_fn = weighted_factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(4)
    data = []
    for step in range(4):
        y = torch.randint(0, CLASSES - 1, (BATCH,), generator=gen)
        if step == bad_step:
            y[rare] = CLASSES - 1
        x = torch.randn(BATCH, 5, generator=gen)
        data.append({"x": x, "y": y, "index": torch.arange(BATCH) + BATCH * step})
    guarded(model, opt, loss_fn, data, run_dir)
    return captures(run_dir)


# -- class 3: a target the mask forbids -----------------------------------------------------------

TOKENS, POSITIONS = 7, 5


class SchemaDecoder(nn.Module):
    """Per-position logits over ``TOKENS``, masked to the tokens the schema allows there."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(6, TOKENS)

    def forward(self, x: Tensor, allowed: Tensor) -> Tensor:
        logits: Tensor = self.proj(x)
        return logits.masked_fill(~allowed, float("-inf"))


def schema_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    logits = model(batch["x"], batch["allowed"]).reshape(-1, TOKENS)
    return F.cross_entropy(logits, batch["target"].reshape(-1))  # ROOT:masked_target


def schema_factory() -> tuple[nn.Module, Any]:
    return SchemaDecoder(), schema_loss


def schema_batches(micro: int, bad: tuple[int, int, int] | None) -> list[dict[str, Tensor]]:
    """``micro`` micro-batches; ``bad``: (micro-batch, sample, position) whose target is a
    token the schema forbids there (the others: an allowed one)."""
    gen = torch.Generator().manual_seed(6)
    out = []
    for m in range(micro):
        allowed = torch.rand(BATCH, POSITIONS, TOKENS, generator=gen) > 0.5
        allowed[..., 0] = True  # every position allows some token
        scores = torch.rand(BATCH, POSITIONS, TOKENS, generator=gen) + allowed.float()
        target = scores.argmax(-1)  # an allowed token
        if bad is not None and bad[0] == m:
            target[bad[1], bad[2]] = int((~allowed[bad[1], bad[2]]).nonzero()[0])
        x = torch.randn(BATCH, POSITIONS, 6, generator=gen)
        index = torch.arange(BATCH) + BATCH * m
        out.append({"x": x, "allowed": allowed, "target": target, "index": index})
    return out


def schema_run(run_dir: Path | str, bad: tuple[int, int, int] = (1, 2, 3)) -> list[Path]:
    """Two steps of two micro-batches each; the second step's micro-batch ``bad[0]``."""
    good = schema_batches(2, None)
    data = [*good, *schema_batches(2, bad)]
    model = SchemaDecoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guarded(model, opt, schema_loss, data, run_dir, accumulation=2)
    return captures(run_dir)


# -- class 4: exp overflows where the loss does not look ------------------------------------------


class ManualSoftmax(nn.Module):
    def forward(self, z: Tensor) -> Tensor:
        e = torch.exp(z)  # ROOT:hidden_overflow
        return e / e.sum(-1, keepdim=True)


class ProbNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 4)
        self.softmax = ManualSoftmax()

    def forward(self, x: Tensor) -> Tensor:
        return self.softmax(self.fc(x))  # type: ignore[no-any-return]


def target_nll(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The target's probability only, made safe from log(0) with an epsilon."""
    p: Tensor = model(batch["x"])
    return -(p.gather(1, batch["y"][:, None]) + 1e-6).log().mean()


def softmax_factory() -> tuple[nn.Module, Any]:
    return ProbNet(), target_nll


def outlier(model: ProbNet, scale: float = 100.0, cls: int = 2) -> Tensor:
    """An input whose logit of class ``cls`` is about ``scale`` (exp overflows float32)."""
    w = model.fc.weight.detach()[cls]
    return w / w.dot(w) * scale


def prob_batches(
    steps: int, bad: tuple[int, int] | None, seed: int = 0, y_bad: int = 0
) -> list[dict[str, Tensor]]:
    """``bad``: (batch, sample) that is the outlier (target ``y_bad``, not its class 2)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    probe = ProbNet()
    for i in range(steps):
        x = torch.randn(BATCH, 5, generator=gen)
        y = torch.randint(0, 2, (BATCH,), generator=gen)
        if bad is not None and bad[0] == i:
            x[bad[1]] = outlier(probe)
            y[bad[1]] = y_bad
        out.append({"x": x, "y": y, "index": torch.arange(BATCH) + BATCH * i + 1000 * seed})
    return out


def softmax_run(run_dir: Path | str, bad: tuple[int, int] = (2, 5)) -> list[Path]:
    model = ProbNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    guarded(model, opt, target_nll, prob_batches(4, bad), run_dir)
    return captures(run_dir)


# -- class 5: an in-place division ---------------------------------------------------------------


class InPlaceNorm(nn.Module):
    """Logits divided in place by the input's sum of magnitudes (0/0 for a zero sample)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 3, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h: Tensor = self.fc(x)
        return h.div_(x.abs().sum(-1, keepdim=True))  # ROOT:in_place


# -- 2-rank DDP runs (tg_dist.run_ranks workers) ------------------------------------------------


def softmax_worker(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """Class 4 on 2 DDP ranks with 2 micro-batches a step: rank 1's micro-batch 1 of step 1
    holds the outlier (sample 5); the all-reduce spreads the NaN gradient to rank 0."""
    from torch.nn.parallel import DistributedDataParallel

    model = ProbNet()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    bad = (3, 5) if rank == 1 else None  # item 3: step 1's second micro-batch
    data = prob_batches(4, bad, seed=rank)
    guard = guarded(ddp, opt, target_nll, data, run_dir, accumulation=2)
    return {"nonfinite_steps": list(guard.state.nonfinite_steps)}


def rows_worker(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """Class 1b on 2 DDP ranks: only rank 1's sample 3 of step 2 is a long sequence."""
    from torch.nn.parallel import DistributedDataParallel

    model = grown_position_model()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    long = (3,) if rank == 1 else ()
    data = sequences(4, 2 if rank == 1 else -1, long, seed=2 + rank)
    guard = guarded(ddp, opt, seq_loss, data, run_dir)
    return {"nonfinite_steps": list(guard.state.nonfinite_steps)}


def dist_worker(rank: int, world: int, softmax_dir: str, rows_dir: str) -> dict[str, Any]:
    """Both runs in one spawn (the process start-up is most of a test's time)."""
    return {
        "softmax": softmax_worker(rank, world, softmax_dir),
        "rows": rows_worker(rank, world, rows_dir),
    }


def root_line(name: str) -> int:
    """The line number of the ``# ROOT:<name>`` marker in this file."""
    with open(__file__, encoding="utf-8") as source:
        for number, text in enumerate(source, 1):
            if text.rstrip().endswith(f"# ROOT:{name}"):
                return number
    raise KeyError(name)
