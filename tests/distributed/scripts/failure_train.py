"""A deterministic DDP job that loses a rank mid-run (CPU, gloo), for torchrun restarts.

``python failure_train.py RUN_DIR OUT [--kill-at S[,S2]] [--hang-at S] [--steps N]``: rank 1
SIGKILLs itself (``--kill-at``), or hangs (``--hang-at``), when step S's batch arrives, on
attempt k for the k-th step given (TORCHELASTIC_RESTART_COUNT). The model has dropout (each
rank's RNG matters) and BatchNorm; the guard checkpoints every 50 steps and resumes. Rank 0
writes the final weights and the attempt's steps to OUT: a run that loses a rank must end
with the weights of an uninterrupted one, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import trainguard as tg


def _steps(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def _corrupt_states(run_dir: str) -> None:
    """Rank 0 of a restart flips a byte in the middle of every state at a failure."""
    from pathlib import Path

    from trainguard.recovery.failure.store import job_folder, states

    if os.environ.get("RANK") != "0":
        return
    for state in states(job_folder(Path(run_dir), None)):
        data = bytearray(state.path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.path.write_bytes(bytes(data))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=_steps, default=[])
    parser.add_argument("--hang-at", type=_steps, default=[])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hang-timeout", type=float, default=5.0)
    parser.add_argument("--no-failure-state", action="store_true")
    parser.add_argument("--corrupt-states", action="store_true")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard), not DDP")
    parser.add_argument(
        "--per-node", action="store_true", help="a run folder and state folder per node"
    )
    args = parser.parse_args()
    state_dir = None
    if args.per_node:  # nothing shared between the nodes (torchrun's GROUP_RANK: the node)
        node = os.environ["GROUP_RANK"]
        state_dir = os.path.join(args.run_dir, f"node{node}-shm")
        args.run_dir = os.path.join(args.run_dir, f"node{node}")
    torch.set_num_threads(1)
    if args.corrupt_states and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        _corrupt_states(args.run_dir)  # before the rendezvous: no rank resumes before it
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8 * args.steps, 8, generator=gen)
    dataset = TensorDataset(x, x @ torch.randn(8, 4, generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    torch.manual_seed(rank)  # each rank's own dropout
    model = nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 4)
    )
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    config = tg.GuardConfig(
        run_dir=args.run_dir,
        hang_timeout=args.hang_timeout,
        checkpoint_every=0 if args.per_node else 50,  # a checkpoint needs a shared folder
        resume=True,
        recovery=tg.RecoveryConfig(
            save_at_failure=not args.no_failure_state, failure_state_dir=state_dir
        ),
    )
    guard = tg.Guard(model, opt, scheduler=sched, config=config)
    started = None
    with guard:
        for xb, yb in guard.watch(loader, epoch=0):
            step = guard.state.step
            if started is None:
                started = (step, time.time())
            if rank == 1 and attempt < len(args.kill_at) and step == args.kill_at[attempt]:
                with open(os.path.join(args.run_dir, f"fault-{attempt}.json"), "w") as f:
                    json.dump({"time": time.time(), "step": step}, f)
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 1 and attempt < len(args.hang_at) and step == args.hang_at[attempt]:
                time.sleep(3600)
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            if guard.check(loss):
                opt.step()
                sched.step()
            opt.zero_grad(set_to_none=True)
    full = [getattr(p, "full_tensor", p.detach)() for p in model.parameters()]  # FSDP2: gathered
    if rank == 0:
        flat = torch.cat([p.detach().reshape(-1) for p in full])
        torch.save({"params": flat, "step": guard.state.step}, args.out)
        with open(args.out + f".attempt{attempt}.json", "w") as f:
            json.dump(
                {
                    "first_step": started[0] if started else None,
                    "first_time": started[1] if started else None,
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
