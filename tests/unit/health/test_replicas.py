"""Replica agreement, one process: the majority rule, the fingerprint's sensitivity, when a
check is due, and that a check which agrees costs no collective."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from tg_models import TinyNet
from torch import nn

import trainguard as tg
from trainguard.config import GuardConfig
from trainguard.events import EventLog
from trainguard.health.replicas import ReplicaWatch, agree, majority, param_sum, replicated_params
from trainguard.health.resync import user_module

CPU = torch.device("cpu")


def _watch(tmp_path: Path, model: nn.Module, world_size: int = 4, every: int = 4) -> ReplicaWatch:
    config = GuardConfig(run_dir=tmp_path, replica_check_every=every)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ReplicaWatch(model, opt, config, EventLog(tmp_path, 0), 0, world_size, None)


def _fp(watch: ReplicaWatch, step: int = 0) -> float:
    return float(watch.fingerprint(step, CPU))


# -- the majority rule ---------------------------------------------------------------------


def test_one_rank_off_is_named_against_the_majority() -> None:
    verdict = majority([1.5, 1.5, 2.5, 1.5])
    assert (verdict.ranks, verdict.reference, verdict.tie) == ([2], 0, False)


def test_the_majority_need_not_hold_rank_zero() -> None:
    verdict = majority([9.0, 1.5, 1.5, 1.5])
    assert (verdict.ranks, verdict.reference, verdict.tie) == ([0], 1, False)


def test_two_ranks_that_differ_are_a_tie_naming_both() -> None:
    verdict = majority([1.0, 2.0])
    assert (verdict.ranks, verdict.reference, verdict.tie) == ([0, 1], 0, True)


def test_an_even_split_is_a_tie_naming_every_rank() -> None:
    verdict = majority([1.0, 2.0, 2.0, 1.0])
    assert (verdict.ranks, verdict.reference, verdict.tie) == ([0, 1, 2, 3], 0, True)


def test_a_non_finite_fingerprint_is_never_the_majority() -> None:
    verdict = majority([math.nan, 1.0])
    assert (verdict.ranks, verdict.reference, verdict.tie) == ([0], 1, False)
    verdict = majority([math.nan, math.inf, math.nan, 3.0])
    assert (verdict.ranks, verdict.reference, verdict.tie) == ([0, 1, 2], 3, False)


def test_agreement_is_exact_and_non_finite_values_agree_with_each_other() -> None:
    assert agree([0.1 + 0.2, 0.1 + 0.2, 0.1 + 0.2])
    assert not agree([0.1 + 0.2, 0.3, 0.3])  # one ulp apart
    assert agree([math.nan, math.nan])
    assert agree([0.0, -0.0])


# -- the fingerprint -----------------------------------------------------------------------


def test_healthy_replicas_fingerprint_bit_identically(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    twin = copy.deepcopy(model)
    first = _fp(_watch(tmp_path, model))
    assert first != 0.0 and first == _fp(_watch(tmp_path, twin))
    assert first == _fp(_watch(tmp_path, model))  # deterministic


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.encoder.fc.weight[3, 5].add_(1e-3),
        lambda m: m.head.bias[0].sub_(1e-3),
        lambda m: m.encoder.fc.weight[0, 0].fill_(float("nan")),
        lambda m: m.head.weight[1, 1].fill_(float("inf")),
    ],
    ids=["plus_1e-3", "minus_1e-3_bias", "nan", "inf"],
)
def test_one_element_changes_the_fingerprint(tmp_path: Path, change: object) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    before = _fp(_watch(tmp_path, model))
    with torch.no_grad():
        change(model)  # type: ignore[operator]
    after = _fp(_watch(tmp_path, model))
    assert after != before


def test_changes_in_two_parameters_do_not_cancel(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    before = _fp(_watch(tmp_path, model))
    with torch.no_grad():
        model.encoder.fc.bias[0].add_(0.5)
        model.head.bias[0].sub_(0.5)
    assert _fp(_watch(tmp_path, model)) != before


def test_fingerprint_is_a_float64_scalar_on_the_device_and_sums_are_exact() -> None:
    param = torch.full((1000,), 0.1, dtype=torch.float32)
    expected = math.fsum([float(torch.tensor(0.1, dtype=torch.float32))] * 1000)
    total = param_sum(param)
    assert total.dtype == torch.float64 and total.shape == () and total.device == CPU
    assert float(total) == pytest.approx(expected, rel=0, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_large_cpu_parameter_is_summed_by_its_bit_patterns(dtype: torch.dtype) -> None:
    """At BIT_SUM_MIN elements and above: the wrapped integer sum of the elements' bit
    patterns (a float64 holding it exactly), whatever the thread count; one element one
    ulp away changes it; a NaN or an Inf anywhere makes it NaN."""
    from trainguard.health.replicas import BIT_SUM_MIN

    gen = torch.Generator().manual_seed(0)
    param = torch.randn(BIT_SUM_MIN + 7, generator=gen).to(dtype)
    word = torch.int32 if dtype == torch.float32 else torch.int16
    wrapped = sum(param.view(word).tolist()) % 2**32
    expected = wrapped - 2**32 if wrapped >= 2**31 else wrapped
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = param_sum(param)
        torch.set_num_threads(2)
        assert torch.equal(param_sum(param), alone)
    finally:
        torch.set_num_threads(threads)
    assert alone.dtype == torch.float64 and alone.shape == () and float(alone) == expected
    nudged = param.clone()
    nudged[12345] = torch.nextafter(nudged[12345], torch.tensor(math.inf, dtype=dtype))
    assert float(param_sum(nudged)) != expected
    for bad in (math.nan, math.inf, -math.inf):
        broken = param.clone()
        broken[-1] = bad
        assert math.isnan(float(param_sum(broken)))


def test_large_parameters_are_summed_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainguard.health.replicas as replicas

    values = torch.randn(1001, dtype=torch.float32)
    whole = float(param_sum(values))
    monkeypatch.setattr(replicas, "_CHUNK", 100)
    assert float(param_sum(values)) == pytest.approx(whole, rel=1e-15)


def test_ddp_names_and_ignored_parameters(tmp_path: Path) -> None:
    class Wrapped(nn.Module):  # stands in for DDP: the user's module under .module
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

    Wrapped.__name__ = "DistributedDataParallel"
    inner = TinyNet()
    assert user_module(Wrapped(inner)) is inner
    inner._ddp_params_and_buffers_to_ignore = ["head.bias"]  # type: ignore[assignment]
    names = [name for name, _ in replicated_params(Wrapped(inner))]
    assert names == ["encoder.fc.weight", "encoder.fc.bias", "head.weight"]


def test_a_copy_beside_a_ddp_module_is_not_a_replica(tmp_path: Path) -> None:
    """timm's training task holds the DDP-wrapped network and an EMA copy made on each rank
    before the wrap: only the parameters inside DDP are replicas (DDP made them equal)."""

    class Wrapped(nn.Module):  # stands in for DDP: the user's module under .module
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

    Wrapped.__name__ = "DistributedDataParallel"

    class Task(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            net = TinyNet()
            self.ema = copy.deepcopy(net)
            self.trained = Wrapped(net)

    task = Task()
    task.trained.module._ddp_params_and_buffers_to_ignore = ["head.bias"]  # type: ignore[union-attr]
    names = [name for name, _ in replicated_params(task)]
    assert names == [
        "trained.module.encoder.fc.weight",
        "trained.module.encoder.fc.bias",
        "trained.module.head.weight",
    ]
    plain = [name for name, _ in replicated_params(TinyNet())]  # no DDP: every parameter
    assert plain == [name for name, _ in TinyNet().named_parameters()]


# -- when a check is due -------------------------------------------------------------------


def test_due_only_on_the_cadence_with_several_replicas(tmp_path: Path) -> None:
    watch = _watch(tmp_path, TinyNet(), every=4)
    assert [s for s in range(13) if watch.due(s)] == [0, 4, 8, 12]
    assert _fp(watch, 3) == 0.0 and _fp(watch, 4) != 0.0
    assert not _watch(tmp_path, TinyNet(), every=0).due(0)
    assert not _watch(tmp_path, TinyNet(), world_size=1).due(0)


def test_fsdp2_shards_are_never_checked(tmp_path: Path) -> None:
    model = TinyNet()
    model.head.weight.to_local = lambda: model.head.weight  # type: ignore[attr-defined]
    watch = _watch(tmp_path, model)
    assert not watch.due(0)
    assert _fp(watch, 0) == 0.0


def test_agreeing_or_undue_checks_take_no_collective(tmp_path: Path) -> None:
    """torch.distributed is not initialized here: any collective would raise."""
    watch = _watch(tmp_path, TinyNet())
    fp = _fp(watch, 4)
    watch.observe(4, [fp] * 4)
    watch.observe(5, [0.0, 1.0, 0.0, 0.0])  # not due: ignored
    assert watch.checks == 1 and watch.diverged_at is None
    assert tg.read_events(tmp_path) == []
    assert watch._sums == {}  # nothing kept once observed


def test_config_rejects_bad_options(tmp_path: Path) -> None:
    with pytest.raises(tg.ConfigError, match="replica_check_every"):
        GuardConfig(run_dir=tmp_path, replica_check_every=-1)
    with pytest.raises(tg.ConfigError, match="on_divergence"):
        GuardConfig(run_dir=tmp_path, on_divergence="fix")  # type: ignore[arg-type]


def test_divergence_error_carries_the_step_ranks_and_params() -> None:
    exc = tg.ReplicaDivergenceError("differ", step=8, ranks=[2], params=["head.weight"])
    assert isinstance(exc, tg.TrainGuardError)
    assert (exc.step, exc.ranks, exc.params) == (8, [2], ["head.weight"])


def _diverged_watch(
    tmp_path: Path, action: str, model: nn.Module | None = None
) -> tuple[ReplicaWatch, list[float]]:
    """Rank 2 of 4 holds +1e-3 in head.weight (the gather is faked: no process group)."""
    torch.manual_seed(0)
    model = model or TinyNet()
    config = GuardConfig(run_dir=tmp_path, replica_check_every=4, on_divergence=action)  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = ReplicaWatch(model, opt, config, EventLog(tmp_path, 0), 0, 4, None)
    good = watch.fingerprint(8, CPU)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.head.weight[0, 0].add_(1e-3)
    odd_sums = ReplicaWatch(twin, opt, config, EventLog(tmp_path, 9), 2, 4, None).param_sums(CPU)
    bad = float((odd_sums * watch._factors_on(CPU)).sum())
    rows = [watch._sums[8], watch._sums[8], odd_sums, watch._sums[8]]

    def fake_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.clone() for _ in range(4)] if tensor.numel() == 1 else rows

    watch._all_gather = fake_gather  # type: ignore[method-assign]
    return watch, [float(good), float(good), bad, float(good)]


def test_a_divergence_is_reported_with_ranks_and_params(tmp_path: Path) -> None:
    watch, fingerprints = _diverged_watch(tmp_path, "warn")
    watch.observe(8, fingerprints)
    (event,) = [e for e in tg.read_events(tmp_path) if e["kind"] == "replica_divergence"]
    assert event["step"] == 8 and event["ranks"] == [2] and event["majority_rank"] == 0
    assert event["params"] == ["head.weight"] and event["params_differing"] == 1
    assert event["action"] == "warn" and event["tie"] is False
    assert watch.diverged_at == 8 and watch.divergence is not None
    assert watch.divergence["params"] == ["head.weight"]


class FakeDDP(nn.Module):  # stands in for DDP (known by its type's name)
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    @property
    def head(self) -> nn.Module:  # the twin's nudge reaches the wrapped module
        head: nn.Module = self.module.head
        return head


FakeDDP.__name__ = "DistributedDataParallel"


def test_a_plain_model_apart_at_the_first_check_is_taken_for_no_replicas(
    tmp_path: Path,
) -> None:
    """The ranks each train a model of their own (PyTorch's ImageNet example on CPU, where
    it wraps no DDP): apart at the first check, before any update made them so. Said once,
    then not checked again; under DDP, which made the weights equal, every check reports."""
    watch, fingerprints = _diverged_watch(tmp_path / "plain", "warn")
    watch.observe(8, fingerprints)
    (event,) = tg.read_events(tmp_path / "plain")
    assert event["no_replicas"] is True and watch.no_replicas
    assert not watch.due(12) and _fp(watch, 12) == 0.0

    wrapped, fingerprints = _diverged_watch(tmp_path / "ddp", "warn", FakeDDP(TinyNet()))
    wrapped.observe(8, fingerprints)
    (event,) = tg.read_events(tmp_path / "ddp")
    assert event["no_replicas"] is False and wrapped.due(12)


def test_a_plain_model_that_drifts_apart_after_an_equal_first_check_is_taken_for_no_replicas(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """PyTorch's ImageNet example on CPU with ``--seed``: every rank builds the same model
    and no DDP holds it, so the first check finds them equal and the next, after updates
    nothing averaged, apart. Said once with that cause, then not checked again."""
    watch, fingerprints = _diverged_watch(tmp_path, "warn")
    watch.observe(4, [fingerprints[0]] * 4)
    with caplog.at_level("WARNING", logger="trainguard.health.replicas"):
        watch.observe(8, fingerprints)
    (event,) = tg.read_events(tmp_path)
    assert event["no_replicas"] is True and watch.no_replicas and not watch.due(12)
    (said,) = [r.getMessage() for r in caplog.records]
    assert "drifted apart with their updates: nothing averages their gradients" in said
    assert "wrap the model in DistributedDataParallel" in said


def test_a_divergence_that_stays_is_said_once_and_again_after_the_replicas_agreed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under DDP with ``warn`` nothing repairs a divergence: each later check finding the
    same ranks apart writes its event and says nothing; once a check finds them equal (a
    rollback, a resync by hand), the next divergence is said again."""
    watch, fingerprints = _diverged_watch(tmp_path, "warn", FakeDDP(TinyNet()))
    agreed = [fingerprints[0]] * 4
    with caplog.at_level("WARNING", logger="trainguard.health.replicas"):
        for step, seen in [(4, agreed), (8, fingerprints), (12, fingerprints), (16, agreed)]:
            watch.observe(step, seen)
        assert len(caplog.records) == 1 and "step 8: replicas diverged" in caplog.text
        watch.observe(20, fingerprints)
    events = tg.read_events(tmp_path)
    assert [e["step"] for e in events] == [8, 12, 20] and not watch.no_replicas
    assert [r.getMessage()[:40] for r in caplog.records] == [
        "trainguard: step 8: replicas diverged: r",
        "trainguard: step 20: replicas diverged: ",
    ]


def test_raise_names_the_option_and_the_fix(tmp_path: Path) -> None:
    watch, fingerprints = _diverged_watch(tmp_path, "raise")
    with pytest.raises(tg.ReplicaDivergenceError, match="on_divergence='resync'") as info:
        watch.observe(8, fingerprints)
    assert (info.value.step, info.value.ranks, info.value.params) == (8, [2], ["head.weight"])
    assert [e["action"] for e in tg.read_events(tmp_path)] == ["raise"]


def test_resync_rebuilds_a_missing_optimizer_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiving rank whose optimizer never stepped ends with the source's exact state:
    the source's broadcasts are recorded, then replayed into the receiver in order."""
    import trainguard.health.resync as resync

    torch.manual_seed(0)
    source = TinyNet()
    receiver = copy.deepcopy(source)
    with torch.no_grad():
        receiver.head.weight.add_(1.0)
    src_opt = torch.optim.Adam(source.parameters(), lr=0.1)
    source(torch.randn(3, 8)).sum().backward()
    src_opt.step()
    recv_opt = torch.optim.Adam(receiver.parameters(), lr=0.1)  # no state at all
    sent: list[torch.Tensor] = []
    layout: list[object] = []

    def record(tensor: torch.Tensor, src: int, group: object = None) -> None:
        sent.append(tensor.clone())

    def record_layout(obj: object, src: int, group: object, device: object) -> object:
        layout.append(obj)
        return obj

    monkeypatch.setattr(resync.dist, "broadcast", record)
    monkeypatch.setattr(resync, "broadcast_object", record_layout)
    resync.broadcast_state(source, src_opt, 0, None, CPU)

    def replay(tensor: torch.Tensor, src: int, group: object = None) -> None:
        tensor.copy_(sent.pop(0))

    def replay_layout(obj: object, src: int, group: object, device: object) -> object:
        return layout[0]

    monkeypatch.setattr(resync.dist, "broadcast", replay)
    monkeypatch.setattr(resync, "broadcast_object", replay_layout)
    resync.broadcast_state(receiver, recv_opt, 0, None, CPU)
    assert sent == []
    for a, b in zip(source.parameters(), receiver.parameters(), strict=True):
        assert torch.equal(a, b)
        src_state, recv_state = src_opt.state[a], recv_opt.state[b]
        assert set(src_state) == set(recv_state) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(src_state[k], recv_state[k]) for k in src_state)
