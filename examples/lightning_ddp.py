"""A Lightning DDP run (2 CPU processes, gloo) where one sample on rank 1 blows the loss up.

    python examples/lightning_ddp.py --run-dir runs/lightning
    trainguard replay runs/lightning/captures/step-* --factory examples/lightning_ddp.py:make_replay

Sample 27 is 1e30 (Lightning's distributed sampler hands it to rank 1): its squared error
overflows to inf, the all-reduced gradients
turn NaN on both ranks. The ``TrainGuard`` callback sees it in ``on_before_optimizer_step``,
skips that step on both ranks (same decision), writes a capture bundle, and training goes
on. ``--out DIR`` writes each rank's final weights and guard counters (used by the tests).

``--strategy fsdp2`` runs the same with FSDP2: Lightning's ``ModelParallelStrategy`` and
``fully_shard`` in ``configure_model`` (CPU-capable, unlike ``strategy="fsdp"``, FSDP1).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, Dataset

from trainguard import read_events
from trainguard.integrations.lightning import TrainGuard, replay_spec

SAMPLES = 64
POISONED = 2 * 13 + 1
"""A sample that lands on rank 1 under Lightning's DistributedSampler (2 ranks)."""


class Points(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, n: int = SAMPLES, poisoned: int | None = POISONED) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
        if poisoned is not None:
            self.x[poisoned] = 1e30  # finite, but its squared error is not

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def configure_model(self) -> None:
        """Under ``--strategy fsdp2`` (Lightning's ``ModelParallelStrategy``): shard the net
        with FSDP2's ``fully_shard`` over the data-parallel ranks (no-op otherwise)."""
        mesh = self.device_mesh  # set by ModelParallelStrategy, else None
        if mesh is not None and not isinstance(self.net, FSDPModule):
            fully_shard(self.net, mesh=mesh["data_parallel"])

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def make_replay() -> Any:
    """The replay factory: the module the run trained, its training_step as the loss."""
    return replay_spec(Regressor())


def strategy(name: str, devices: int) -> Any:
    """``fsdp2``: Lightning's FSDP2 route (``strategy="fsdp"`` is FSDP1, GPU-only in torch
    2.13: "FSDP needs a non-CPU accelerator device"); other names go to Lightning as they are."""
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return name


def full_weights(model: nn.Module) -> dict[str, list[float]]:
    """Every weight, whole (FSDP2 shards are gathered: a collective, on every rank)."""
    weights = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        weights[name] = full.float().flatten().tolist()
    return weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", default="runs/lightning")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument(
        "--strategy",
        default="ddp",
        help="ddp, ddp_spawn, or fsdp2 (ModelParallelStrategy + fully_shard, CPU-capable)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    L.seed_everything(0, verbose=False)
    model = Regressor()
    guard = TrainGuard(run_dir=args.run_dir, hang_timeout=120)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy(args.strategy, args.devices),
        precision=args.precision,
        accumulate_grad_batches=args.accumulate,
        max_epochs=1,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[guard],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    train = DataLoader(Points(), batch_size=4)
    val = DataLoader(Points(16, poisoned=None), batch_size=4)
    trainer.fit(model, train, val)
    # ddp_spawn: the guard ran in the spawned processes; its events are on disk either way
    state = guard.state_dict().get("state", {})
    skipped = sorted({e["step"] for e in read_events(args.run_dir, 0) if e["kind"] == "skip"})
    if trainer.global_rank == 0:
        print(
            f"trained {trainer.global_step} steps on {trainer.world_size} ranks; "
            f"non-finite steps skipped: {skipped}; "
            f"bundles: {sorted(str(p) for p in Path(args.run_dir, 'captures').glob('step-*'))}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "rank": trainer.global_rank,
            "global_step": trainer.global_step,
            "state": state,
            "params": full_weights(model),
        }
        (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
