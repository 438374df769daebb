"""The job ``goodput.py`` runs: a small DDP model on the CPU (gloo), faults on a schedule.

``torchrun ... goodput_job.py MODE RUN_DIR [options]``, MODE one of:

- ``bare``: the loop's own ``torch.save`` checkpoint (model, optimizer, step) every
  ``--checkpoint-every`` steps on rank 0, loaded on a restart; its own finite check (the
  total gradient norm, ``clip_grad_norm_``: a non-finite norm raises, torchrun restarts the
  job); its own watchdog thread (no step ended for ``--hang-timeout`` s: ``os._exit(1)``, so
  torchrun restarts the job; gloo's own timeout is 30 minutes);
- ``tg_checkpoint``: ``tg.Guard(checkpoint_every=K, resume=True, on_escalation="rollback",
  hang_timeout=T, recovery.save_at_failure=False)``: a restart resumes from the newest good
  checkpoint on disk;
- ``tg_failure_state``: the same with ``recovery.save_at_failure=True`` (the default): the
  survivors write the state at the start of the step in flight, the restart resumes there;
- ``torchft``: run by ``ft-launch`` below with the torchft venv's Python: each rank is a
  replica group of one process under its own ``torchrun --nproc-per-node=1``, a
  ``torchft.Manager`` over ``ProcessGroupGloo``, ``torchft.DistributedDataParallel`` and
  ``torchft.Optimizer``; the loop's finite check calls ``manager.report_error`` (the step is
  not committed) and the same watchdog thread as ``bare`` ends a hung replica (paused inside
  torchft's calls, which have torchft's timeouts: a survivor waits there for its peer). On
  the first attempt both groups wait for each other before the first quorum (a file
  barrier), so neither trains alone at the start.

``python goodput_job.py ft-launch RUN_DIR --torchrun PATH --ports P0,P1 --max-restarts N
[options]`` starts torchft's ``LighthouseServer`` in the launching process
(``min_replicas=1``, its other defaults) and one torchrun per replica group, waits for group
0 to finish, then ends group 1.

The faults, each once (a marker file in RUN_DIR, made before the fault, so neither a
restarted job nor a rollback repeats it): ``--kill-at S``: rank 1 SIGKILLs itself when step
S's batch is in hand; ``--hang-at S``: rank 1 sleeps there for an hour; ``--nan-at S``: rank
1's loss is NaN on ``--nan-steps`` consecutive steps from step S (DDP's all-reduce spreads
its NaN gradients to every rank). Each fault appends ``{kind, step, time, attempt}`` to
RUN_DIR/faults.jsonl.

Each rank (replica group) appends a line per step it ends to RUN_DIR/steps-rank<r>.csv:
``attempt, step, t_start, t_end, applied, participants`` (``t_start``: the batch in hand;
``t_end``: after the optimizer step; ``applied``: the update was applied; ``participants``:
ranks whose gradients the step averaged), and its start-up timeline to
RUN_DIR/attempts-rank<r>.jsonl. Wall-clock times (``time.time()``): they compare across
processes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

POOL = 16
"""Distinct batches per rank, reused in turn (making a batch costs nothing then: a resumed
guard reads and drops the consumed ones)."""

Batch = tuple[torch.Tensor, torch.Tensor]


# -- the workload --------------------------------------------------------------------------------


def build_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in every mode
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(width, 8))


def batch_pool(rank: int, width: int, batch: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.randn(width, 8, generator=torch.Generator().manual_seed(7)) / width**0.5
    pool = []
    for _ in range(POOL):
        x = torch.randn(batch, width, generator=gen)
        pool.append((x, torch.tanh(x @ teacher)))
    return pool


class Stream:
    """``count`` batches from the pool in turn: what the guard's ``watch()`` iterates."""

    def __init__(self, pool: list[Batch], count: int) -> None:
        self.pool, self.count = pool, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Batch]:
        for i in range(self.count):
            yield self.pool[i % len(self.pool)]


# -- faults and the step log ---------------------------------------------------------------------


class Faults:
    """The schedule; rank 1 injects. ``begin(step)`` runs when a step's batch is in hand and
    says whether this step's loss is to be NaN."""

    def __init__(self, args: argparse.Namespace, rank: int, attempt: int) -> None:
        self.run_dir: Path = args.run_dir
        self.rank, self.attempt = rank, attempt
        self.kill_at: int | None = args.kill_at
        self.hang_at: int | None = args.hang_at
        self.nan_at: int | None = args.nan_at
        self.nan_steps: int = args.nan_steps
        self.nan_left = 0

    def _once(self, kind: str, step: int) -> bool:
        """True the first time any attempt asks for ``kind`` (the marker is made atomically)."""
        try:
            fd = os.open(self.run_dir / f"fault-{kind}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.close(fd)
        line = {"kind": kind, "step": step, "time": time.time(), "attempt": self.attempt}
        with open(self.run_dir / "faults.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")
        return True

    def begin(self, step: int) -> bool:
        if self.rank != 1:
            return False
        if self.kill_at is not None and step >= self.kill_at and self._once("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.hang_at is not None and step >= self.hang_at and self._once("hang", step):
            time.sleep(3600)
        if self.nan_at is not None and step >= self.nan_at and self._once("nan", step):
            self.nan_left = self.nan_steps
        if self.nan_left > 0:
            self.nan_left -= 1
            return True
        return False


class StepLog:
    """A rank's line per step, written through at once (a SIGKILL loses nothing written)."""

    def __init__(self, run_dir: Path, rank: int, attempt: int) -> None:
        self.attempt = attempt
        flags = os.O_CREAT | os.O_APPEND | os.O_WRONLY
        self.fd = os.open(run_dir / f"steps-rank{rank}.csv", flags)

    def write(self, step: int, start: float, applied: bool, participants: int) -> None:
        line = f"{self.attempt},{step},{start:.6f},{time.time():.6f},{int(applied)},"
        os.write(self.fd, (line + f"{participants}\n").encode())


def process_start() -> float | None:
    """When this process started (wall clock), from /proc: before Python and torch loaded.
    The start is in clock ticks since boot; the boot-time clock now gives its age."""
    try:
        with open("/proc/self/stat", encoding="utf-8") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def mark(run_dir: Path, rank: int, attempt: int, what: str, when: float | None = None) -> None:
    """A rank's start-up timeline of each attempt (``attempts-rank<r>.jsonl``): ``process``
    (its start), ``main`` (torch imported), ``process_group``, ``ready`` (model, optimizer,
    guard or torchft manager built: the resume)."""
    line = {"attempt": attempt, "what": what, "time": when or time.time()}
    with open(run_dir / f"attempts-rank{rank}.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\n")


class Watchdog:
    """The bare loop's own: no step ended for ``timeout`` s ends the process (exit 1)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.last = time.monotonic()
        self.waiting = False
        threading.Thread(target=self._run, daemon=True, name="goodput-watchdog").start()

    def beat(self) -> None:
        self.last = time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not watching inside (calls with timeouts of their own); a beat on leaving."""
        self.waiting = True
        try:
            yield
        finally:
            self.waiting = False
            self.beat()

    def _run(self) -> None:
        while True:
            time.sleep(min(0.5, self.timeout / 4))
            if not self.waiting and time.monotonic() - self.last > self.timeout:
                print(f"goodput watchdog: no step for {self.timeout} s, exiting", flush=True)
                os._exit(1)


def nan_loss(loss: torch.Tensor) -> torch.Tensor:
    return loss * float("nan")


# -- the modes -----------------------------------------------------------------------------------


def run_bare(args: argparse.Namespace, rank: int, attempt: int) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(build_model(args.width, args.depth))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pool = batch_pool(rank, args.width, args.batch)
    faults, log = Faults(args, rank, attempt), StepLog(args.run_dir, rank, attempt)
    path = args.run_dir / "bare-checkpoint.pt"
    start = 0
    if path.exists():
        state = torch.load(path, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    mark(args.run_dir, rank, attempt, "ready")
    watchdog = Watchdog(args.hang_timeout)
    for step in range(start, args.steps):
        if step % args.checkpoint_every == 0 and step > start and rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict()}
            torch.save({**state, "step": step}, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        xb, yb = pool[step % POOL]
        t0 = time.time()
        bad = faults.begin(step)
        loss = nn.functional.mse_loss(model(xb), yb)
        if bad:
            loss = nan_loss(loss)
        loss.backward()  # type: ignore[no-untyped-call]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
        if not torch.isfinite(norm):
            raise FloatingPointError(f"non-finite gradient norm at step {step}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.write(step, t0, True, dist.get_world_size())
        watchdog.beat()
    return int(args.steps)


def run_guard(args: argparse.Namespace, rank: int, attempt: int) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainguard as tg

    model = DDP(build_model(args.width, args.depth))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pool = batch_pool(rank, args.width, args.batch)
    faults, log = Faults(args, rank, attempt), StepLog(args.run_dir, rank, attempt)
    config = tg.GuardConfig(
        run_dir=args.run_dir / "tg",
        hang_timeout=args.hang_timeout,
        checkpoint_every=args.checkpoint_every,
        resume=True,
        on_escalation="rollback",
        recovery=tg.RecoveryConfig(save_at_failure=args.mode == "tg_failure_state"),
    )
    guard = tg.Guard(model, opt, config=config)
    mark(args.run_dir, rank, attempt, "ready")
    # a rollback skips the batches that led to it: the stream runs on past ``steps`` batches
    data = Stream(pool, args.steps + 20 * (args.nan_steps + 20))
    with guard:
        for xb, yb in guard.watch(data, epoch=0):
            step = guard.state.step
            if step >= args.steps:
                break
            t0 = time.time()
            bad = faults.begin(step)
            loss = nn.functional.mse_loss(model(xb), yb)
            if bad:
                loss = nan_loss(loss)
            loss.backward()  # type: ignore[no-untyped-call]
            applied = guard.check(loss)
            if applied:
                opt.step()
            opt.zero_grad(set_to_none=True)
            log.write(step, t0, applied, dist.get_world_size())
        final = int(guard.state.step)
    return final


def run_torchft(args: argparse.Namespace, rank: int, attempt: int) -> int:
    """One replica group of one process (``rank``: the group's id)."""
    ft: Any = importlib.import_module("torchft")
    model = build_model(args.width, args.depth)
    pool = batch_pool(rank, args.width, args.batch)
    faults, log = Faults(args, rank, attempt), StepLog(args.run_dir, rank, attempt)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    timeout = timedelta(seconds=args.hang_timeout)
    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=timeout),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"goodput_{rank}",
        timeout=timeout,
    )
    ddp = ft.DistributedDataParallel(manager, model)
    if attempt == 0:  # both groups heartbeating before the first quorum: they start together
        (args.run_dir / f"ft-ready-{rank}").touch()
        while not (args.run_dir / f"ft-ready-{1 - rank}").exists():
            time.sleep(0.05)
    mark(args.run_dir, rank, attempt, "ready")
    opt = ft.Optimizer(manager, inner)
    # watches the loop's own code: torchft's calls (the quorum, the all-reduce, the commit)
    # have torchft's timeouts, and a survivor waits in them while a peer is hung
    watchdog = Watchdog(args.hang_timeout)
    position = 0
    try:
        while manager.current_step() < args.steps:
            step = int(manager.current_step())
            xb, yb = pool[position % POOL]
            position += 1
            t0 = time.time()
            bad = faults.begin(step)
            with watchdog.paused():
                opt.zero_grad(set_to_none=True)  # starts the quorum
                loss = nn.functional.mse_loss(ddp(xb), yb)
                if bad:
                    loss = nan_loss(loss)
                loss.backward()  # type: ignore[no-untyped-call]
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
                if not torch.isfinite(norm):
                    manager.report_error(FloatingPointError(f"non-finite grad norm at {step}"))
                opt.step()  # commits only where every participant's step succeeded
            applied = int(manager.current_step()) > step
            log.write(step, t0, applied, int(manager.num_participants()))
            watchdog.beat()
    finally:
        manager.shutdown(wait=False)
    return int(manager.current_step())


def ft_launch(args: argparse.Namespace) -> int:
    """torchft's lighthouse in this process, one torchrun per replica group."""
    ft: Any = importlib.import_module("torchft._torchft")
    lighthouse = ft.LighthouseServer(bind="[::]:0", min_replicas=1)  # its other defaults
    procs = []
    passed = [
        f"--steps={args.steps}",
        f"--checkpoint-every={args.checkpoint_every}",
        f"--hang-timeout={args.hang_timeout}",
        f"--nan-steps={args.nan_steps}",
        f"--width={args.width}",
        f"--depth={args.depth}",
        f"--batch={args.batch}",
        str(args.run_dir),
    ]
    for name in ("kill_at", "hang_at", "nan_at"):
        if getattr(args, name) is not None:
            passed.append(f"--{name.replace('_', '-')}={getattr(args, name)}")
    try:
        for group in range(2):
            env = {
                **os.environ,
                "TORCHFT_LIGHTHOUSE": lighthouse.address(),
                "GOODPUT_GROUP": str(group),
            }
            command = [
                args.torchrun,
                "--nnodes=1",
                "--nproc-per-node=1",
                f"--max-restarts={args.max_restarts}",
                f"--master-port={args.ports[group]}",
                __file__,
                "torchft",
                *passed,
            ]
            procs.append(subprocess.Popen(command, env=env))
        # group 0 is measured: when it has trained every step, the job is done
        code = procs[0].wait()
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[1].wait(timeout=5)
    finally:
        for proc in procs:  # torchrun's agent ends its workers on SIGTERM
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        lighthouse.shutdown()
    return code


# -- the command line ----------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("mode", choices=("bare", "tg_checkpoint", "tg_failure_state", "torchft",
                                    "ft-launch"))  # fmt: skip
    p.add_argument("run_dir", type=Path)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--hang-timeout", type=float, default=5.0)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--hang-at", type=int)
    p.add_argument("--nan-at", type=int)
    p.add_argument("--nan-steps", type=int, default=5)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=128)
    # ft-launch only
    p.add_argument("--torchrun", default="torchrun")
    p.add_argument("--max-restarts", type=int, default=4)
    p.add_argument("--ports", type=lambda s: [int(x) for x in s.split(",")], default=[0, 0])
    return p.parse_args(argv)


def main() -> int:
    args = parse()
    if args.mode == "ft-launch":
        return ft_launch(args)
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    runs: dict[str, Callable[[argparse.Namespace, int, int], int]] = {
        "bare": run_bare,
        "tg_checkpoint": run_guard,
        "tg_failure_state": run_guard,
        "torchft": run_torchft,
    }
    rank = int(os.environ.get("GOODPUT_GROUP", os.environ.get("RANK", "0")))
    started = process_start()
    if started is not None:
        mark(args.run_dir, rank, attempt, "process", started)
    mark(args.run_dir, rank, attempt, "main")
    if args.mode == "torchft":
        final = runs[args.mode](args, rank, attempt)
    else:
        dist.init_process_group("gloo")
        mark(args.run_dir, rank, attempt, "process_group")
        final = runs[args.mode](args, rank, attempt)
        dist.destroy_process_group()
    if rank == 0:
        with open(args.run_dir / "done.json", "w", encoding="utf-8") as fh:
            json.dump({"final_step": final, "attempt": attempt, "time": time.time()}, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
