"""Guarded runs whose bundles test the replay's fidelity: autocast, the origin rank, replicas.

- ``Overflow``: a linear layer with unit weights; a sample of 2e4 makes its float16 output
  exceed 65504 under ``torch.autocast("cpu", dtype=torch.float16)``, finite in float32.
- ``origin_worker``: a 2-rank DDP run whose rank 1 holds an all-zero sample that makes
  ``sqrt``'s gradient 0/0 in backward (finite loss); DDP's all-reduce spreads it to rank 0.
- ``replica_worker``: a 2-rank DDP run whose rank 1 nudges one weight by +1e-3 after DDP's
  start-up broadcast (a rank-local write); a loss fault on rank 1 triggers the capture.
- ``loss_only_worker``: a 2-rank DDP run whose rank 1's loss is 0/0 (an empty class) while
  every gradient stays finite.
- ``guarded_loop``: a plain guarded loop with the loop's own ``forward(x)`` (``normalize``
  before it, for the cases below and ``tests/unit/replay/test_forward_inputs.py``).
- ``made_in_loop_worker``: a 2-rank DDP run whose loop normalizes each batch by its std;
  rank 1's batch at step 1 has a constant feature: 0/0 in the model's input, not in the batch.
- ``ddp_worker``: these, one after the other, in one spawn.
- ``set_meta``: rewrite keys of a rank's ``meta.json`` (and its manifest checksum), e.g. the
  ``autocast`` key the guard records.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tg_capture_models as models
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import trainguard as tg
from trainguard.capture.bundle import MANIFEST, write_json

D = 4
BATCH = 8
CLASSES = 3
BIG = 2.0e4
FP16_CPU = {"enabled": True, "device_type": "cpu", "dtype": "float16"}


class Overflow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, D)
        nn.init.constant_(self.lin.weight, 1.0)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(torch.relu(self.lin(x)))  # 4 x 2e4 > 65504 in float16
        return out


def ce(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def overflow_factory() -> tuple[nn.Module, Any]:
    return Overflow(), ce


def overflow_batches(steps: int = 3, bad_step: int = 1, bad_pos: int = 5) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        x = torch.randn(BATCH, D, generator=gen)
        if step == bad_step:
            x[bad_pos] = BIG
        index = torch.arange(step * BATCH, (step + 1) * BATCH) + 1000
        out.append({"x": x, "y": torch.arange(BATCH) % CLASSES, "index": index})
    return out


def train_under_autocast(run_dir: Path, dtype: torch.dtype = torch.float16) -> Path:
    """A guarded SGD loop whose forward and loss run under CPU autocast; the bundle."""
    return _guarded_under_autocast(Overflow(), ce, overflow_batches(), run_dir, dtype, 0.01)


def _guarded_under_autocast(
    model: nn.Module, loss_fn: Any, batches: list[Any], run_dir: Path, dtype: torch.dtype, lr: float
) -> Path:
    """A guarded SGD loop whose forward and loss run under CPU autocast: its one bundle."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=0) as guard:
        for batch in guard.watch(batches):
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_fn(model, batch)
            loss.backward()
            if guard.check(loss):
                optimizer.step()
            optimizer.zero_grad()
    (bundle,) = sorted((run_dir / "captures").glob("step-*"))
    return bundle


def set_meta(bundle: Path, rank: int, **keys: Any) -> None:
    """Set ``keys`` in ``rank-{rank}/meta.json`` and update its checksum in the manifest."""
    path = bundle / f"rank-{rank}" / "meta.json"
    meta = json.loads(path.read_text(encoding="utf-8"))
    meta.update(keys)
    record = write_json(path, meta)
    manifest_path = bundle / MANIFEST
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    manifest["files"][f"rank-{rank}/meta.json"] = record.to_manifest()
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


# -- 2-rank DDP runs (tg_dist.run_ranks workers) ------------------------------------------------


def origin_worker(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """Rank 1's batch at step 2 holds an all-zero sample at position 5: 0/0 in sqrt's
    gradient on rank 1 only; the loss is finite on both ranks."""
    from torch.nn.parallel import DistributedDataParallel

    data = models.batches("backward", 3, bad_step=2 if rank == 1 else -1, seed=rank)
    model = DistributedDataParallel(models.make_model("backward"))
    guard = models.train(model, models.ce_loss, data, run_dir)
    return {"nonfinite_steps": list(guard.state.nonfinite_steps)}


def replica_worker(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """Rank 1 adds 1e-3 to ``head.weight[0, 0]`` after DDP's broadcast; a loss fault on
    rank 1 at step 1 makes the guard capture the step (the replicas already differ)."""
    from torch.nn.parallel import DistributedDataParallel

    from trainguard.testing import Fault, FaultPlan

    model = DistributedDataParallel(models.make_model("clean"))
    if rank == 1:
        with torch.no_grad():
            model.module.head.weight[0, 0] += 1e-3
    data = models.batches("clean", 2, bad_step=-1, seed=rank)
    plan = FaultPlan([Fault(step=1, rank=1, where="loss")])
    guard = models.train(model, models.ce_loss, data, run_dir, plan=plan)
    return {"nonfinite_steps": list(guard.state.nonfinite_steps)}


def loss_only_worker(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """Rank 1's batch at step 1 lacks a class: its class-balanced loss is 0/0 = NaN, but no
    gradient flows through the empty class, so every rank's gradients stay finite."""
    from torch.nn.parallel import DistributedDataParallel

    data = models.batches("loss", 2, bad_step=1 if rank == 1 else -1, seed=rank)
    model = DistributedDataParallel(models.make_model("loss"))
    guard = models.train(model, models.balanced_loss, data, run_dir)
    return {"nonfinite_steps": list(guard.state.nonfinite_steps)}


def normalize(x: Tensor) -> Tensor:
    """A loop's own transform between the fetch and the forward: per-feature standardization
    (0/0 = NaN for a constant feature)."""
    return (x - x.mean(0)) / x.std(0)


def guarded_loop(
    module: nn.Module,
    opt: torch.optim.Optimizer,
    run_dir: str | Path,
    data: Any,
    forward: Any,
) -> list[bool]:
    """A plain guarded loop over ``watch(data)`` of ``(x, y)`` batches: ``forward(x)`` (the
    loop's own code before and in the forward), MSE, ``check()``; the decisions."""
    decisions = []
    with tg.Guard(module, opt, run_dir=run_dir) as guard:
        for x, y in guard.watch(data):
            loss = F.mse_loss(forward(x), y)
            loss.backward()
            decisions.append(guard.check(loss))
            if decisions[-1]:
                opt.step()
            opt.zero_grad()
    return decisions


def made_in_loop_worker(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """The loop normalizes each fetched batch by its own std; rank 1's batch at step 1 has a
    constant feature, so the normalized input holds 0/0 = NaN that the fetched batch does
    not. Returns the decisions and the final weights."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    data = [(torch.randn(6, 4, generator=gen), torch.randn(6, 1, generator=gen)) for _ in range(3)]
    if rank == 1:
        data[1][0][:, 3] = 0.25
    decisions = guarded_loop(model, opt, run_dir, data, lambda x: model(normalize(x)))
    return {"decisions": decisions, "weights": [p.detach().clone() for p in model.parameters()]}


def made_in_loop_factory() -> tuple[nn.Module, Any]:
    """The replay factory of ``made_in_loop_worker``: its model, the loss of a fetched batch
    (without the loop's normalization)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, lambda m, batch: F.mse_loss(m(batch[0]), batch[1])


def ddp_worker(
    rank: int,
    world: int,
    origin_dir: str,
    replica_dir: str,
    loss_dir: str | None = None,
    loop_dir: str | None = None,
) -> dict[str, Any]:
    """The runs above in one spawn (the process start-up is most of a test's time)."""
    out = {
        "origin": origin_worker(rank, world, origin_dir),
        "replica": replica_worker(rank, world, replica_dir),
    }
    if loss_dir is not None:
        out["loss"] = loss_only_worker(rank, world, loss_dir)
    if loop_dir is not None:
        out["loop"] = made_in_loop_worker(rank, world, loop_dir)
    return out


# -- a half dtype's rounding at a domain edge (not an overflow) ----------------------------------


class Confident(nn.Module):
    """A logit of 0.24 * the features' sum: 9.6 for a sample of 40s (sigmoid rounds to 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        with torch.no_grad():
            self.lin.weight.fill_(0.06)
            self.lin.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x).squeeze(-1)  # type: ignore[no-any-return]


def hand_bce(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    """Binary cross-entropy written by hand: ``log(1 - sigmoid(z))`` is ``log(0)`` once the
    half dtype rounds ``sigmoid(z)`` to 1 (no value out of its range)."""
    p = torch.sigmoid(model(batch["x"]))
    y = batch["y"]
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def rounding_factory() -> tuple[nn.Module, Any]:
    return Confident(), hand_bce


def train_rounding_under_autocast(run_dir: Path, dtype: torch.dtype) -> Path:
    """A guarded loop under CPU autocast whose step 1 holds a mis-scaled sample (position 5,
    dataset index 13): the bundle."""
    gen = torch.Generator().manual_seed(9)
    batches = []
    for step in range(3):
        x = torch.randn(8, 4, generator=gen) * 0.3
        if step == 1:
            x[5] = 40.0
        batches.append({"x": x, "y": torch.zeros(8), "index": torch.arange(8) + 8 * step})
    return _guarded_under_autocast(Confident(), hand_bce, batches, run_dir, dtype, 1e-3)


# -- an additive attention mask carried in the batch --------------------------------------------

SEQ, WIDTH = 6, 8


class BiasAttention(nn.Module):
    """One attention layer whose scores get the batch's additive bias (0 / -inf)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (
            nn.Linear(WIDTH, WIDTH),
            nn.Linear(WIDTH, WIDTH),
            nn.Linear(WIDTH, WIDTH),
        )
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2) + bias[:, None, :]
        return self.head((torch.softmax(scores, -1) @ self.v(x)).mean(1))  # type: ignore[no-any-return]


def bias_loss(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    return F.cross_entropy(model(batch["x"], batch["bias"]), batch["y"])


def bias_factory() -> tuple[nn.Module, Any]:
    return BiasAttention(), bias_loss


def train_with_bias(
    run_dir: Path, check_inputs: bool, empty: int | None, allow_masks: bool = False
) -> Path:
    """Batches of sequences padded by an additive bias in the batch; ``empty``: the sample
    of step 1 (dataset index 10 + empty) with no valid token (its whole row -inf).
    ``allow_masks`` off by default here: the bias is then a bad input, captured."""
    model = BiasAttention()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(3)
    batches = []
    for step in range(3):
        lengths = torch.randint(2, SEQ + 1, (BATCH,), generator=gen)
        if step == 1 and empty is not None:
            lengths[empty] = 0
        bias = torch.zeros(BATCH, SEQ)
        for row, length in enumerate(lengths.tolist()):
            bias[row, length:] = float("-inf")
        x = torch.randn(BATCH, SEQ, WIDTH, generator=gen)
        y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
        batches.append({"x": x, "bias": bias, "y": y, "index": torch.arange(BATCH) + 10 * step})
    with tg.Guard(
        model,
        optimizer,
        run_dir=run_dir,
        hang_timeout=0,
        inputs=tg.InputConfig(check=check_inputs, allow_masks=allow_masks),
    ) as guard:
        for batch in guard.watch(batches):
            loss = bias_loss(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            if guard.check(loss):
                optimizer.step()
            optimizer.zero_grad()
    return sorted((run_dir / "captures").glob("step-*"))[0]
