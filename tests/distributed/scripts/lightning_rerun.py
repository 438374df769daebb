"""``TrainGuard(rerun=True)`` under ``Trainer(strategy="ddp", devices=2, accelerator="cpu")``.

Lightning's DDP launcher re-runs this script for rank 1 (see tests/distributed/
test_lightning.py for why it is a script). Each process fits twice per strategy, in the same
process group: ``clean`` (no one-off fault) and ``fault`` (a forward hook on rank 1 poisons
one output once, at ``FAULT_STEP``'s first micro-batch). Both runs hold a NaN sample on rank
0 at ``NAN_STEP``: a persistent fault. The model has BatchNorm and dropout, the Trainer
accumulates 2 micro-batches (under DDP the rerun's first runs in Lightning's ``no_sync``).
Strategies: ``ddp``, and ``fsdp2`` (``ModelParallelStrategy``, ``fully_shard`` in
``configure_model``). ``--out DIR`` gets ``rank{r}.pt``: each run's state_dict (whole
tensors), its RNG draw after training and the guard's counters.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, TensorDataset

from trainguard.integrations.lightning import TrainGuard

SAMPLES = 48  # a rank: each rank loads its own (use_distributed_sampler=False)
BATCH = 4
ACCUMULATE = 2  # 6 optimizer steps
FAULT_STEP = 1
NAN_STEP = 4
NAN_SAMPLE = (NAN_STEP * ACCUMULATE + 1) * BATCH + 2  # rank 0: step 4, 2nd micro-batch


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1)
        )

    def configure_model(self) -> None:
        """Under ModelParallelStrategy: FSDP2 over the data-parallel ranks (else no-op)."""
        mesh = self.device_mesh
        if mesh is not None and not isinstance(self.net, FSDPModule):
            fully_shard(self.net, mesh=mesh["data_parallel"])

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        return data(self.global_rank)


class OneOff:
    """Poisons ``module``'s output on rank 1 once, in the first forward of ``step``."""

    def __init__(self, module: nn.Module, callback: TrainGuard, step: int) -> None:
        self.callback, self.step, self.done = callback, step, False
        module.register_forward_hook(self)

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        guard = self.callback.guard
        if self.done or guard is None or guard.state.step != self.step or guard.rank != 1:
            return None
        self.done = True
        return output * float("nan")


def data(rank: int) -> DataLoader[tuple[Tensor, ...]]:
    """The rank's own samples; rank 0's sample NAN_SAMPLE holds a NaN."""
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(SAMPLES, 4, generator=gen), torch.randn(SAMPLES, generator=gen)
    if rank == 0:
        x[NAN_SAMPLE, 1] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def strategy(name: str) -> Any:
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    return name


def fit(run_dir: Path, strategy_name: str, fault: bool) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    model = Net()
    callback = TrainGuard(run_dir=str(run_dir), hang_timeout=0, capture=False, rerun=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy(strategy_name),
        accumulate_grad_batches=ACCUMULATE,
        max_epochs=1,
        use_distributed_sampler=False,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if fault:
        OneOff(model.net[0], callback, FAULT_STEP)
    trainer.fit(model)
    state = {k: whole(v) for k, v in model.state_dict().items()}
    return {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "state": state,
        "guard": callback.state_dict()["state"],
        "rng": torch.rand(3),
    }


def whole(value: Tensor) -> Tensor:
    """A state_dict entry, whole (an FSDP2 shard is gathered: a collective, every rank)."""
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp2"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.simplefilter("ignore")
    results: dict[str, Any] = {}
    for name in args.strategies:
        for run in ("clean", "fault"):
            results[f"{name}/{run}"] = fit(args.run_dir / name / run, name, run == "fault")
    args.out.mkdir(parents=True, exist_ok=True)
    rank = results[f"{args.strategies[0]}/clean"]["rank"]
    torch.save(results, args.out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
