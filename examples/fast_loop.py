"""A hand-written fast loop with nanoGPT's structure, guarded by trainguard.

    python examples/fast_loop.py                                    # one process
    torchrun --nproc-per-node=2 examples/fast_loop.py               # 2-rank DDP on CPU (gloo)
    torchrun --nproc-per-node=2 examples/fast_loop.py --resume --steps 60   # go on from ckpt.pt
    trainguard replay runs/fast_loop/captures/step-00000012 \\
        --factory examples/fast_loop.py:make_replay     # importing this file trains nothing

What nanoGPT's train.py does, on a tiny GPT (``fast_loop_model.py``) and random tokens in a
``np.memmap`` file: ``get_batch(split)``, the next batch fetched before backward, gradient
accumulation with ``require_backward_grad_sync``, ``torch.autocast`` (bfloat16 on CPU;
float16 with an enabled GradScaler on CUDA), gradient clipping, a hand-written ``get_lr(it)``,
rank-0-only evaluation and checkpointing, and resuming from its own checkpoint. The lines
trainguard changes are marked ``# trainguard``; docs/existing-loop.md walks through them.

``--poison-step N --poison-rank R`` makes rank R's data bad at step N: every target of its
first micro-batch is -1, nanoGPT's ``ignore_index``, so that micro-batch's mean loss is 0/0 =
NaN (a fully padded batch). Every rank skips the step, the bundle replays. ``--poison-where
loss`` poisons the loss instead (``trainguard.testing``: the model is fine, replay says "not
reproduced", as for a transient hardware fault). ``--poison-steps K``: K steps in a row
(5 = max_consecutive: a rollback). ``--out DIR``: each rank's final weights and guard state.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from fast_loop_model import GPT, GRADIENT_ACCUMULATION_STEPS, GPTConfig
from fast_loop_model import make_replay as make_replay  # the replay factory, importable here
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg  # trainguard
from trainguard.testing import Fault, FaultPlan

# -- nanoGPT's configuration, small ---------------------------------------------------------
batch_size = 8
block_size = GPTConfig.block_size
gradient_accumulation_steps = GRADIENT_ACCUMULATION_STEPS
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 5
lr_decay_iters = 200
grad_clip = 1.0
eval_interval = 10
eval_iters = 2
log_interval = 5
tokens = 50_000  # per split, in the memmap file


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="max_iters: optimizer steps")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/fast_loop"))
    parser.add_argument("--data-dir", type=Path, default=None, help="default: RUN_DIR/data")
    parser.add_argument("--resume", action="store_true", help="go on from RUN_DIR/ckpt.pt")
    parser.add_argument("--poison-step", type=int, default=None)
    parser.add_argument("--poison-rank", type=int, default=0)
    parser.add_argument("--poison-steps", type=int, default=1, help="bad steps in a row")
    parser.add_argument("--poison-where", choices=("batch", "loss"), default="batch")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="nanoGPT's compile=True: torch.compile(model) before DDP (default backend inductor)",
    )
    parser.add_argument("--out", type=Path, default=None, help="each rank's final weights")
    return parser.parse_args()


def prepare_data(data_dir: Path, vocab_size: int) -> None:
    """Random tokens as nanoGPT's train.bin / val.bin (uint16), each the previous one plus 1,
    2 or 3 (mod the vocabulary): learnable, the loss falls from ln(256) = 5.5 towards ln(3) =
    1.1. Every rank writes the same bytes to a file of its own and renames it into place, so
    no rank reads a partial file."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for i, split in enumerate(("train", "val")):
        path = data_dir / f"{split}.bin"
        if not path.exists():
            steps = np.random.default_rng(i).integers(1, 4, size=tokens)
            ids = (np.cumsum(steps) % vocab_size).astype(np.uint16)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            ids.tofile(tmp)
            os.replace(tmp, path)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        device = f"cuda:{os.environ['LOCAL_RANK']}" if args.device == "cuda" else "cpu"
        if args.device == "cuda":
            torch.cuda.set_device(device)
    else:
        rank, world_size, device = 0, 1, args.device
    master_process = rank == 0
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    # nanoGPT: bfloat16 where supported; float16 (with a GradScaler) on CUDA here, to show it.
    dtype = torch.float16 if device_type == "cuda" else torch.bfloat16
    ctx = torch.autocast(device_type=device_type, dtype=dtype)
    torch.manual_seed(1337)  # the same initial weights on every rank
    run_dir: Path = args.run_dir
    data_dir = args.data_dir or run_dir / "data"
    config = GPTConfig()
    prepare_data(data_dir, config.vocab_size)
    if master_process:
        print(f"{world_size} rank(s) on {device}, autocast {dtype}, {args.steps} steps", flush=True)

    def get_batch(split: str, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        data = np.memmap(data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
        x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack(
            [torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix]
        )
        return x.to(device), y.to(device)

    # -- model, optimizer, scaler, checkpoint -------------------------------------------------
    model: Any = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.1)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    ckpt_path = run_dir / "ckpt.pt"
    checkpoint: dict[str, Any] | None = None
    if args.resume:
        checkpoint = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    raw_model = model
    if args.compile:
        model = torch.compile(model, backend=args.compile)  # the guard's hooks stay eager
    if ddp:
        model = DDP(model)

    guard = tg.Guard(  # trainguard
        model,
        optimizer,
        scaler=scaler,  # unscaled before the check; disabled (a no-op) on CPU
        run_dir=run_dir,
        accumulation_steps=gradient_accumulation_steps,  # micro-batches per optimizer step
        grad_clip=grad_clip,  # replaces scaler.unscale_ + clip_grad_norm_
        on_escalation="rollback",  # 5 bad steps in a row: back to a good snapshot in memory
        run="continue" if args.resume else "new",  # a resumed launch goes on with the run
    )
    if checkpoint is not None:
        guard.load_state_dict(checkpoint["guard"])  # trainguard: step and counters go on
    iter_num = guard.global_step  # 0, or the checkpoint's iter_num

    # -- data: an endless stream of training batches, with its own RNG -------------------------
    faults = FaultPlan(
        [Fault(step=s, rank=args.poison_rank) for s in poison_range(args)]
        if args.poison_where == "loss"
        else []
    )

    def train_batches() -> Iterator[tuple[Tensor, Tensor]]:
        generator = torch.Generator().manual_seed(1337 + 1000 * rank + iter_num)
        position = iter_num * gradient_accumulation_steps  # micro-batches before this one
        while True:
            x, y = get_batch("train", generator)
            step, micro = divmod(position, gradient_accumulation_steps)
            bad = args.poison_where == "batch" and rank == args.poison_rank and micro == 0
            if bad and step in poison_range(args):
                y.fill_(-1)  # every target ignored: this micro-batch's mean loss is 0/0
            position += 1
            yield x, y

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        generator = torch.Generator().manual_seed(7)  # evaluation draws from its own RNG
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                x, y = get_batch(split, generator)
                with ctx:
                    _, loss = model(x, y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    def get_lr(it: int) -> float:
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return min_lr + coeff * (learning_rate - min_lr)

    def save_checkpoint(iter_num: int) -> None:
        state = {
            "model": raw_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "iter_num": iter_num,
            "guard": guard.state_dict(),  # trainguard: plain values, no collective
        }
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, ckpt_path)

    # -- the loop -----------------------------------------------------------------------------
    batches = guard.watch(train_batches())  # trainguard: was X, Y = get_batch("train")
    X, Y = next(batches)  # fetch the very first batch
    t0 = time.time()
    while True:
        iter_num = guard.global_step  # trainguard: a rollback moves it back
        if iter_num >= args.steps:
            break
        lr = get_lr(iter_num)  # the guard applies its own LR backoff factor on top
        lr_factor = guard.lr_factor  # trainguard: only to log the LR in force
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr

        if iter_num % eval_interval == 0 and master_process:
            with guard.phase("eval"):  # trainguard: the other ranks wait, this is no hang
                losses = estimate_loss()
                print(
                    f"step {iter_num}: train loss {losses['train']:.4f}, val loss "
                    f"{losses['val']:.4f}",
                    flush=True,
                )
                if iter_num > 0:
                    save_checkpoint(iter_num)

        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                last = micro_step == gradient_accumulation_steps - 1
                model.require_backward_grad_sync = last  # all-reduce on the last one only
            with ctx:
                _, loss = model(X, Y)
                loss = faults.loss(loss, iter_num)  # --poison-where loss
                loss = loss / gradient_accumulation_steps
            guard.record_loss(loss)  # trainguard: each micro-batch's loss, no sync
            X, Y = next(batches)  # prefetch the next batch (watch() already holds it)
            scaler.scale(loss).backward()
        if guard.check(loss):  # trainguard: unscale, check, clip; the same answer on every rank
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % log_interval == 0 and master_process:
            lossf = loss.item() * gradient_accumulation_steps
            print(
                f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e} (x{lr_factor:g}), "
                f"time {dt * 1000:.0f}ms",
                flush=True,
            )

    if master_process:
        save_checkpoint(iter_num)  # at the end too: --resume goes on from here
        metrics = guard.metrics()
        print("guard: " + ", ".join(f"{k.split('/')[-1]} {v:g}" for k, v in metrics.items()))
    guard.close()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(raw_model.state_dict(), args.out / f"rank{rank}.pt")
        summary = {"rank": rank, "global_step": guard.global_step, **guard.state_dict()}
        (args.out / f"rank{rank}.json").write_text(json.dumps(summary))
    if ddp:
        dist.destroy_process_group()


def poison_range(args: argparse.Namespace) -> range:
    """The steps ``--poison-step`` / ``--poison-steps`` make bad."""
    if args.poison_step is None:
        return range(0)
    return range(args.poison_step, args.poison_step + args.poison_steps)


if __name__ == "__main__":
    main()
