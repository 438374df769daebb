"""A world of one's usual step (``step/single_process.py``): taken in few calls, decided and
recorded exactly as the full path decides and records it; every other step takes the full
path."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import trainguard as tg
from trainguard.testing import poison_grad, poison_loss

NAN = math.nan
STEPS = 30
BAD_INPUT, BAD_LOSS, BAD_GRAD, SPIKE = 9, 13, 17, 22
"""Steps made bad (an input, the loss, a gradient) or spiking (the loss x 1e4)."""

TIMING = {"time", "step_seconds", "data_times", "compute_times"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1)
    )


def _batches(count: int) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(count)
    ]


class _FullPathCount:
    """Counts the steps the full path measured (``StepPipeline.measure``)."""

    def __init__(self, guard: tg.Guard) -> None:
        self.steps: list[int] = []
        measure = guard._parts.pipeline.measure

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.steps.append(guard.state.step)
            return measure(*args, **kwargs)

        guard._parts.pipeline.measure = counted  # type: ignore[assignment]


def _run(run_dir: Path, lone: bool, shape: str = "plain", **options: Any) -> dict[str, Any]:
    """The same seeded loop (BatchNorm, dropout, clipping, spikes skipped, a bad input, loss
    and gradient), with the usual-step path on or off. ``shape``: ``plain``, ``accumulate``
    (two micro-batches a step, ``check()`` with the last loss, no ``record_loss``),
    ``record`` (the same with ``record_loss`` on every micro-batch) or ``autocast`` (the
    forward under CPU bfloat16 autocast)."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    k = 2 if shape in ("accumulate", "record") else 1
    config = tg.GuardConfig(
        run_dir=run_dir,
        hang_timeout=0,
        grad_clip=1.0,
        on_spike="skip",
        accumulation_steps=k,
        **options,
        spikes=tg.SpikeConfig(warmup=5),
    )
    guard = tg.Guard(model, opt, config=config)
    if not lone:
        guard._parts.pipeline.alone = None
    full = _FullPathCount(guard)
    oks = []
    torch.manual_seed(2)  # dropout
    for index, (x, y) in enumerate(guard.watch(_batches(STEPS * k))):
        step, micro = divmod(index, k)
        if step == BAD_INPUT and micro == 0:
            x = x.clone()
            x[3, 1] = NAN
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=shape == "autocast"):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if step == SPIKE:
            loss = loss * 1e4
        if step == BAD_LOSS and micro == k - 1:
            loss = poison_loss(loss)
        (loss / k).backward()  # type: ignore[no-untyped-call]
        if shape == "record":
            guard.record_loss(loss)
        if micro < k - 1:
            continue
        if step == BAD_GRAD:
            poison_grad(model, "0.weight")
        ok = guard.check(loss)
        oks.append(ok)
        if step == 0:  # learned at the first decided step (``BufferKeeper.learn``)
            learned = sorted(guard._parts.step_start.buffers._tracked)
        if ok:
            opt.step()
        opt.zero_grad()
    state = guard.state_dict()
    guard.close()
    events = [json.loads(line) for line in (run_dir / "events" / "rank-0.jsonl").open()]
    metrics = [json.loads(line) for line in (run_dir / "metrics" / "rank-0.jsonl").open()]
    return {
        "oks": oks,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "state": state,
        "history": [_untimed(r.bundle_fields()) for r in guard.history.records()],
        "metrics": [_untimed(line) for line in metrics],
        "events": [(e["kind"], e["step"]) for e in events if e["kind"] not in ("start", "close")],
        "bundles": [_bundle(p) for p in sorted((run_dir / "captures").glob("*"))],
        "full_path_steps": full.steps,
        "buffers_learned": learned,  # what the step start copies from then on
    }


def _bundle(path: Path) -> dict[str, Any]:
    """A capture as far as it does not name the run, the process or the time."""
    manifest = json.loads((path / "manifest.json").read_text())
    meta = json.loads((path / "rank-0" / "meta.json").read_text())
    return {
        "name": path.name,
        "manifest": {k: v for k, v in manifest.items() if k not in ("time", "time_utc", "run")},
        "meta": {k: v for k, v in meta.items() if k != "env"},
        "batch": _listed(torch.load(path / "rank-0" / "batch.pt", weights_only=False)),
        "rng": torch.load(path / "rank-0" / "rng.pt", weights_only=False)["torch"].tolist(),
    }


def _text(obj: Any) -> str:
    """JSON text (NaN as NaN: equal where == on NaN is not)."""
    return json.dumps(obj, sort_keys=True)


def _listed(obj: Any) -> Any:
    """Tensors as nested lists, for comparing as JSON."""
    if isinstance(obj, Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _listed(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_listed(v) for v in obj]
    return obj


def _untimed(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if k not in TIMING}


@pytest.mark.parametrize("shape", ["plain", "accumulate", "record", "autocast"])
def test_usual_steps_take_the_lone_path_and_change_nothing(tmp_path: Path, shape: str) -> None:
    lone = _run(tmp_path / "lone", lone=True, shape=shape)
    full = _run(tmp_path / "full", lone=False, shape=shape)
    assert full["full_path_steps"] == list(range(STEPS))
    # only the unusual steps took the full path: the bad ones and the last (the stream ran
    # out); the spike, finite for the measure and judged after it, took the lone path
    assert lone["full_path_steps"] == [BAD_INPUT, BAD_LOSS, BAD_GRAD, STEPS - 1]
    assert lone["oks"] == full["oks"]
    assert [i for i, ok in enumerate(lone["oks"]) if not ok] == [
        BAD_INPUT,
        BAD_LOSS,
        BAD_GRAD,
        SPIKE,
    ]
    for name, value in lone["weights"].items():  # BatchNorm statistics included
        assert torch.equal(value, full["weights"][name]), name
    assert lone["buffers_learned"]  # BatchNorm's running statistics
    for key in ("state", "history", "metrics", "events", "bundles", "buffers_learned"):
        assert _text(lone[key]) == _text(full[key]), key
    assert lone["bundles"]  # the first bad step and the spike were captured


def test_lone_path_is_built_for_a_world_of_one_only(tmp_path: Path) -> None:
    model = _model()
    guard = tg.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path)
    assert guard._parts.pipeline.alone is not None and guard.world_size == 1
    guard.close()


def _loop(run_dir: Path, steps: int, body: Any, **options: Any) -> tuple[tg.Guard, list[int]]:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if "config" not in options:
        options = {"run_dir": run_dir, "hang_timeout": 0, **options}
    guard = tg.Guard(model, opt, **options)
    full = _FullPathCount(guard)
    gen = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(4, 4, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(steps)
    ]
    for x, y in guard.watch(data):
        body(guard, model, opt, x, y)
    guard.close()
    return guard, full.steps


def _plain(guard: tg.Guard, model: nn.Module, opt: Any, x: Tensor, y: Tensor) -> None:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    if guard.check(loss):
        opt.step()
    opt.zero_grad()


def test_recorded_losses_take_the_lone_path(tmp_path: Path) -> None:
    recorded: list[int] = []

    def body(guard: tg.Guard, model: nn.Module, opt: Any, x: Tensor, y: Tensor) -> None:
        half = len(x) // 2
        first = nn.functional.mse_loss(model(x[:half]), y[:half])
        first.backward()  # type: ignore[no-untyped-call]
        guard.record_loss(first)
        last = nn.functional.mse_loss(model(x[half:]), y[half:])
        last.backward()  # type: ignore[no-untyped-call]
        guard.record_loss(last)
        recorded.append(guard.state.step)
        if guard.check(last):  # the loss last recorded: counted once
            opt.step()
        opt.zero_grad()

    guard, full = _loop(tmp_path, 4, body)
    assert full == [3]  # the last step only (the end of the data)
    assert recorded == [0, 1, 2, 3] and guard.state.last_good_step == 3


def test_a_float_loss_takes_the_full_path(tmp_path: Path) -> None:
    def body(guard: tg.Guard, model: nn.Module, opt: Any, x: Tensor, y: Tensor) -> None:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        if guard.check(loss.item()):  # a float64 tensor for the guard: the reduced row
            opt.step()
        opt.zero_grad()

    guard, full = _loop(tmp_path, 3, body)
    assert full == [0, 1, 2] and guard.state.last_good_step == 2


def test_float64_inputs_take_the_full_path(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0)
    full = _FullPathCount(guard)
    data = [(torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 1)) for _ in range(3)]
    for x, y in guard.watch(data):
        loss = nn.functional.mse_loss(model(x.float()), y)
        loss.backward()  # type: ignore[no-untyped-call]
        assert guard.check(loss)
        opt.zero_grad()
    guard.close()
    assert full.steps == [0, 1, 2]
    assert (
        guard._parts.pipeline.alone is not None and guard._parts.pipeline.alone.active
    )  # per step, not for good


def test_sparse_gradients_turn_the_lone_path_off_for_the_run(tmp_path: Path) -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    guard = tg.Guard(emb, opt, run_dir=tmp_path, hang_timeout=0)
    full = _FullPathCount(guard)
    for _ in guard.watch(range(3)):
        loss = emb(torch.tensor([1, 2, 3])).pow(2).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        assert guard.check(loss)
        opt.step()
        opt.zero_grad()
    guard.close()
    assert full.steps == [0, 1, 2]
    assert guard._parts.pipeline.alone is not None and not guard._parts.pipeline.alone.active


def test_a_gradscaler_takes_the_full_path(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu")

    def body(guard: tg.Guard, model: nn.Module, opt: Any, x: Tensor, y: Tensor) -> None:
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        if guard.check(loss):
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    _, full = _loop(tmp_path, 3, body, scaler=scaler)
    assert full == [0, 1, 2]


def test_the_step_after_a_bad_one_takes_the_lone_path_again(tmp_path: Path) -> None:
    def body(guard: tg.Guard, model: nn.Module, opt: Any, x: Tensor, y: Tensor) -> None:
        loss = nn.functional.mse_loss(model(x), y)
        if guard.state.step == 2:
            loss = poison_loss(loss)
        loss.backward()  # type: ignore[no-untyped-call]
        if guard.check(loss):
            opt.step()
        opt.zero_grad()

    guard, full = _loop(tmp_path, 5, body)
    assert full == [2, 4]  # the bad step, and the last one (the end of the data)
    assert guard.state.total_nonfinite == 1 and guard.state.last_good_step == 4


@pytest.mark.parametrize("last", [3, 4])
def test_the_end_of_the_data_is_agreed_by_the_full_path(tmp_path: Path, last: int) -> None:
    _, full = _loop(tmp_path, last, _plain)
    # the stream knows it ran out once its lookahead found no more batch: the last step
    assert full == [last - 1]


def test_gradients_alone_take_the_lone_path_and_record_no_loss(tmp_path: Path) -> None:
    """``check_gradients()`` (``trainguard run``): the usual step, with no made-up loss."""

    def body(guard: tg.Guard, model: nn.Module, opt: Any, x: Tensor, y: Tensor) -> None:
        nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        if guard.check_gradients():
            opt.step()
        opt.zero_grad()

    guard, full = _loop(tmp_path, 4, body)
    assert full == [3]  # the last step only (the end of the data)
    assert [r.losses for r in guard.history.records()] == [[]] * 4
    assert "trainguard/loss" not in guard.metrics()
    assert all(r.grad_norm > 0 for r in guard.history.records())


def test_a_skipped_spike_on_the_lone_path_is_not_checked_again(tmp_path: Path) -> None:
    """The usual step hands a spike to the full path's apply; check() answers once."""
    answers: list[bool] = []

    def body(guard: tg.Guard, model: nn.Module, opt: Any, x: Tensor, y: Tensor) -> None:
        loss = nn.functional.mse_loss(model(x), y)
        if guard.state.step == 8:
            loss = loss * 1e6
        loss.backward()  # type: ignore[no-untyped-call]
        answers.append(guard.check(loss))
        opt.step()
        opt.zero_grad()

    config = tg.GuardConfig(
        run_dir=tmp_path, hang_timeout=0, on_spike="skip", spikes=tg.SpikeConfig(warmup=3)
    )
    guard, full = _loop(tmp_path, 10, body, config=config)
    assert full == [9]  # the spike took the lone path; the last step the full one
    assert answers == [True] * 8 + [False, True]
    assert guard.state.step == 10 and guard.spikes.total == 1


def test_a_tensor_learning_rate_is_judged_as_on_the_full_path(tmp_path: Path) -> None:
    """The spike rule's LR grace reads ``host_lr`` (None for a tensor LR); the usual step
    hands it the same number as the full path, also when the LR is a tensor that jumps."""

    def run(lone: bool) -> list[Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.01))
        config = tg.GuardConfig(
            run_dir=tmp_path / str(lone), hang_timeout=0, spikes=tg.SpikeConfig(warmup=2)
        )
        guard = tg.Guard(model, opt, config=config)
        if not lone:
            guard._parts.pipeline.alone = None
        gen = torch.Generator().manual_seed(0)
        data = [(torch.randn(4, 4, generator=gen), torch.randn(4, 1, generator=gen))] * 8
        for step, (x, y) in enumerate(guard.watch(data)):
            if step == 4:
                opt.param_groups[0]["lr"].fill_(1.0)  # a warm restart: x100
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
        grace = guard.spikes.detector.grace
        guard.close()
        return [grace.lr, grace.left, guard.spikes.detector.state_dict()]

    assert run(lone=True) == run(lone=False)


def test_fsdp2_shards_turn_the_lone_path_off_for_the_run(tmp_path: Path) -> None:
    """A world of one under FSDP2 (gloo, one rank): the gradients are DTensor shards, found at
    the first step with gradients, before the fused pass is tried; from then on every step
    takes the full path, which sums shard norms and still skips a NaN step."""
    import torch.distributed as dist
    from tg_dist import cpu_fully_shard

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
        cpu_fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = tg.Guard(model, opt, run_dir=tmp_path / "run", hang_timeout=0)
        lone = guard._parts.pipeline.alone
        assert lone is not None and lone.active  # built: a world of one
        full = _FullPathCount(guard)
        tried: list[int] = []  # the fused pass (it would refuse DTensors too: found before)
        read = lone._read
        lone._read = lambda *a: tried.append(1) or read(*a)  # type: ignore[method-assign]
        decisions = []
        for step, (x, y) in enumerate(guard.watch(_batches(4))):
            loss = nn.functional.mse_loss(model(x), y)
            loss = poison_loss(loss) if step == 2 else loss
            loss.backward()  # type: ignore[no-untyped-call]
            decisions.append(guard.check(loss))
            if decisions[-1]:
                opt.step()
            opt.zero_grad()
        guard.close()
        assert full.steps == [0, 1, 2, 3]
        assert not lone.active and not tried and decisions == [True, True, False, True]
    finally:
        dist.destroy_process_group()
