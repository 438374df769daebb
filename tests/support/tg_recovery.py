"""A small regression job for the recovery tests: one poisoned batch, DDP or FSDP2 on gloo."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tg_dist import cpu_fully_shard
from tg_models import TinyNet
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from trainguard.events import read_events

W_TRUE = torch.Generator().manual_seed(7)


def rollback_config(run_dir: Path, **changes: Any) -> tg.GuardConfig:
    """The recovery tests' rollback set-up: escalate after 3 bad steps, a snapshot every 2
    steps, good after 2 healthy ones, no watchdog."""
    options: dict[str, Any] = {
        "run_dir": run_dir,
        "on_escalation": "rollback",
        "max_consecutive": 3,
        "recovery.snapshot_every": 2,
        "recovery.good_after": 2,
        "hang_timeout": 0,
    }
    return tg.GuardConfig.from_options({**options, **changes})


def make_data(rank: int, n: int, poison: dict[int, float]) -> list[tuple[Tensor, Tensor, float]]:
    """``n`` batches (x, y, corrupt); batch ``i`` in ``poison`` either corrupts the update
    (a huge finite value, or Inf, written into every gradient after the check, as a bad kernel or an
    overflowing optimizer would: the weights are ruined, every later loss is Inf) or, for
    ``nan``, feeds NaN inputs (bad at any weights)."""
    gen = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    out = []
    for i in range(n):
        x = torch.randn(6, 8, generator=gen)
        scale = poison.get(i, 1.0)
        if scale != scale:  # NaN: a batch that is bad at any weights
            x = x * float("nan")
            scale = 1.0
        out.append((x, x @ w, scale))
    return out


def wrap(model: TinyNet, mode: str) -> nn.Module:
    if mode == "plain":
        return model
    if mode == "ddp":
        return DDP(model)
    inner = [model.encoder]
    if mode != "fsdp_root":  # "fsdp_root": the root's own group holds the head's parameters
        inner.append(model.head)
    cpu_fully_shard(*inner, model)
    return model


def full_params(model: nn.Module) -> Tensor:
    parts = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(full.detach().reshape(-1))
    return torch.cat(parts)


def eval_loss(model: nn.Module) -> float:
    data = make_data(99, 4, {})
    with torch.no_grad():
        losses = [nn.functional.mse_loss(model(x), y) for x, y, _ in data]
    return float(torch.stack(losses).mean())


OPTIMIZERS: dict[str, Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "zero_adam": lambda params: _zero_adam(params),
}
"""``train(optimizer=...)``: plain SGD (stateless, the default) or a stateful optimizer
(``zero_adam``: Adam sharded over the ranks by ``ZeroRedundancyOptimizer``, DDP only)."""


def _zero_adam(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    from torch.distributed.optim import ZeroRedundancyOptimizer  # warns about torch.jit

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=0.01)


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """A copy of this rank's optimizer state: ``state`` maps ``"{param}.{key}"`` to the
    tensor (a DTensor's local shard: this rank's part under FSDP2) or value, and ``groups``
    holds each param group's settings (lr, momentum...) without the parameter ids."""
    saved = opt.state_dict()
    state: dict[str, Any] = {}
    for index, per_param in saved["state"].items():
        for key, value in per_param.items():
            if isinstance(value, Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                value = local.detach().clone()
            state[f"{index}.{key}"] = value
    groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    return {"state": state, "groups": groups}


def train(
    rank: int,
    mode: str,
    run_dir: Path,
    batches: int,
    poison: dict[int, float],
    *,
    optimizer: str = "sgd",
    watch_optimizer: bool = False,
    prefetch: bool = False,
    give_scheduler: bool = True,
    ema: bool = False,
    **guard_kwargs: Any,
) -> dict[str, Any]:
    """``watch_optimizer``: copy the optimizer state at the start of every step and, when a
    ``check()`` rolls back, record it (``now``) next to the state the restored step had
    when it last started (``saved``) and the failing step's (``before``), in
    ``out["optimizer_rollbacks"]``; ``out["optimizer_final"]``: the state at the end.
    ``prefetch``: take the next batch right after the forward, before backward and the
    update (nanoGPT's loop). ``ema``: an EMA of the weights (``AveragedModel``, updated
    after each applied step) given to the guard as ``extra_state``: ``out["ema"]`` its final
    weights (gathered from every rank), ``out["ema_rollbacks"]`` per rollback whether it
    came back to what it was when the restored step last started."""
    torch.manual_seed(0)
    model = wrap(TinyNet(), mode)
    opt = OPTIMIZERS[optimizer](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    scheduler = sched if give_scheduler else None  # False: the loop steps one the guard lacks
    if "config" not in guard_kwargs:  # a config holds its own run_dir and hang_timeout
        guard_kwargs = {"run_dir": run_dir, "hang_timeout": 0, **guard_kwargs}
    averaged = _ema_of(model) if ema else None
    if averaged is not None:
        guard_kwargs["extra_state"] = {"ema": averaged}
    guard = tg.Guard(model, opt, scheduler=scheduler, **guard_kwargs)
    out: dict[str, Any] = {"error": None, "ema_rollbacks": []}
    ema_at_start: dict[int, Tensor] = {}
    at_start: dict[int, dict[str, Any]] = {}  # step -> state when it last started
    rollbacks: list[dict[str, Any]] = []
    try:
        with guard:
            stream = iter(guard.watch(make_data(rank, batches, poison)))
            item = next(stream, None)
            while item is not None:
                x, y, scale = item
                step = guard.state.step
                if watch_optimizer:
                    at_start[step] = optimizer_state(opt)
                if averaged is not None:
                    ema_at_start[step] = full_params(averaged).clone()
                loss = nn.functional.mse_loss(model(x), y)
                if prefetch:
                    item = next(stream, None)
                loss.backward()
                ok = guard.check(loss)
                if averaged is not None and guard.state.step <= step:  # rolled back
                    was = ema_at_start[guard.state.step]
                    out["ema_rollbacks"].append(torch.equal(full_params(averaged), was))
                if watch_optimizer and guard.state.step <= step:  # rolled back
                    restored = guard.state.step
                    rollbacks.append(
                        {
                            "step": step,
                            "restored": restored,
                            "saved": at_start.get(restored),
                            "before": at_start[step],
                            "now": optimizer_state(opt),
                        }
                    )
                if ok:
                    if scale != 1.0:
                        for p in model.parameters():
                            p.grad.fill_(scale)  # type: ignore[union-attr]
                    opt.step()
                    sched.step()
                    if averaged is not None:
                        averaged.update_parameters(_inner(model))
                opt.zero_grad(set_to_none=True)
                if not prefetch:
                    item = next(stream, None)
    except tg.NonFiniteError as exc:
        out["error"] = type(exc).__name__
    params = full_params(model)
    gathered = _gathered(params)
    out.update(
        step=guard.state.step,
        finite=bool(torch.isfinite(params).all()),
        same=all(torch.equal(gathered[0], g) for g in gathered),
        params=params,
        eval_loss=eval_loss(model),
        events=[e for e in read_events(run_dir, rank) if e["kind"] in RECOVERY_EVENTS],
    )
    if watch_optimizer:
        out.update(optimizer_rollbacks=rollbacks, optimizer_final=optimizer_state(opt))
    if averaged is not None:
        out["ema"] = _gathered(full_params(averaged))
    return out


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def _ema_of(model: nn.Module) -> torch.optim.swa_utils.AveragedModel:
    ema_fn = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    return torch.optim.swa_utils.AveragedModel(_inner(model), multi_avg_fn=ema_fn)


def _gathered(values: Tensor) -> list[Tensor]:
    """``values`` of every rank (this one's alone in one process)."""
    if not dist.is_initialized():
        return [values]
    out = [torch.zeros_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(out, values)
    return out


RECOVERY_EVENTS = {
    "checkpoint_damaged",
    "checkpoint_good",
    "rollback",
    "rollback_refused",
    "escalate",
    "loss_mismatch",
    "resume",
    "checkpoint",
}
