"""Replay of real captured bundles: phase, op, module, source and culprit samples."""

from __future__ import annotations

import dataclasses
import inspect
import runpy
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import tg_capture_models as models
import torch
from torch import Tensor, nn

import trainguard as tg
from trainguard.replay.bisect import find_culprits
from trainguard.replay.runner import KEYS, resolve_factory
from trainguard.replay.stepper import StepRunner
from trainguard.replay.verdicts import VERDICTS
from trainguard.testing import Fault, FaultPlan

pytestmark = pytest.mark.timeout(60)

SUPPORT = "tg_capture_models.py"


def _capture(scenario: str, run_dir: Path, **kwargs: Any) -> Path:
    data = models.batches(scenario, 4, bad_step=2)
    models.train(models.make_model(scenario), models.loss_of(scenario), data, run_dir, **kwargs)
    (bundle,) = sorted((run_dir / "captures").glob("step-*"))
    return bundle


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One real captured bundle per scenario, replayed with a freshly built model."""
    factories = {
        "forward": models.forward_factory,
        "loss": models.loss_factory,
        "backward": models.backward_factory,
        "inputs": models.clean_factory,
    }
    out = {}
    for scenario, factory in factories.items():
        bundle = _capture(scenario, tmp_path_factory.mktemp(scenario))
        out[scenario] = tg.replay(bundle, factory).to_dict()
    plan = FaultPlan([Fault(step=1, where="grad")])  # a one-off fault after backward
    data = models.batches("clean", 3, bad_step=-1)
    run_dir = tmp_path_factory.mktemp("transient")
    models.train(models.make_model("clean"), models.ce_loss, data, run_dir, plan=plan)
    (bundle,) = (run_dir / "captures").glob("step-*")
    out["transient"] = tg.replay(bundle, models.clean_factory).to_dict()
    return out


class _Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(6, 4)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        za, zb = self.enc(a), self.enc(b)
        return torch.sqrt(((za - zb) ** 2).sum(-1))  # a distance of 0: its gradient is 0/0


def _siamese_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return model(*batch).pow(2).mean()


def test_the_path_holds_the_steps_ops_not_the_replays_own() -> None:
    """Non-finite gradients only: the replay's reads of the loss and the gradients (detach,
    double, pow, sum) run outside the tracer, and an op of the autograd engine itself (the
    gradient's accumulation) names no source: no hop points into trainguard, where the path
    used to end (``cli.py:131``, float64 ``pow``/``sum``)."""
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    b[3] = a[3]  # a duplicated pair
    report = tg.diagnose(_Siamese(), _siamese_loss, (a, b)).to_dict()
    assert report["phase"] == "backward" and report["path"]
    lines, first = inspect.getsourcelines(_Siamese.forward)  # the model's own lines
    model_lines = {f"test_replay.py:{first + i}" for i in range(len(lines))}
    sources = [hop.get("source") for hop in report["path"] if hop.get("op")]
    assert all(s is None or s.endswith(tuple(model_lines)) for s in sources), sources
    assert not any(hop.get("dtype") == "float64" for hop in report["path"]), report["path"]


def _sample(position: int = 5, step: int = 2) -> dict[str, int]:
    return {"micro_batch": 0, "position": position, "index": 1000 + step * models.BATCH + position}


def test_every_report_has_the_contract_keys(reports: dict[str, dict[str, Any]]) -> None:
    for report in reports.values():
        assert list(report)[: len(KEYS)] == list(KEYS)
        assert report["verdict"] in VERDICTS and report["advice"]
        assert report["summary"].endswith(".") and "\n" not in report["summary"]


def test_nan_made_in_a_named_submodule_by_one_sample(reports: dict[str, dict[str, Any]]) -> None:
    r = reports["forward"]
    assert (r["reproduced"], r["deterministic"], r["verdict"]) == (True, True, "numerical")
    assert (r["phase"], r["op"], r["module"]) == ("forward", "aten.div", "encoder.layers.0.norm")
    assert r["source"].endswith(f"{SUPPORT}:29") and "x.norm" in r["code"]
    assert r["culprit_samples"] == [_sample()]
    assert "aten.div(0.0, 0.0) = nan" in r["op_detail"]
    assert "encoder.layers.0.norm" in r["summary"] and "dataset index 1021" in r["summary"]


def test_division_by_zero_in_the_loss_outside_any_module(
    reports: dict[str, dict[str, Any]],
) -> None:
    r = reports["loss"]
    assert (r["phase"], r["op"], r["module"], r["verdict"]) == (
        "loss",
        "aten.div",
        None,
        "batch_statistics",  # an empty class: a statistic the batch is too small for
    )
    assert "sums / counts" in r["code"]
    assert r["culprit_samples"] == []  # the batch lacks a class: no single sample to blame
    assert "no single sample is to blame" in r["summary"]
    assert f"at [{models.CLASSES - 1}]" in r["op_detail"]


def test_gradient_nonfinite_while_forward_is_finite(reports: dict[str, dict[str, Any]]) -> None:
    r = reports["backward"]
    assert (r["phase"], r["op"], r["module"]) == ("backward", "aten.div", "encoder.layers.0.scale")
    assert r["backward"]["grad_fn"] == "SqrtBackward0"
    assert r["backward"]["forward_op"] == "aten.sqrt"
    assert "torch.sqrt" in r["code"]
    assert all(v == v for v in r["replayed"]["losses"])  # the forward loss is finite
    assert r["culprit_samples"] == [_sample()]
    assert r["summary"].startswith("The forward pass was finite")


def test_nan_in_the_batch_itself(reports: dict[str, dict[str, Any]]) -> None:
    r = reports["inputs"]
    assert (r["phase"], r["op"], r["module"], r["verdict"]) == ("inputs", None, None, "bad_input")
    assert r["culprit_samples"] == [_sample()]
    assert "batch['x']" in r["summary"]


def test_one_off_fault_is_not_reproduced(reports: dict[str, dict[str, Any]]) -> None:
    r = reports["transient"]
    assert (r["reproduced"], r["deterministic"], r["verdict"]) == (False, True, "not_reproduced")
    assert r["phase"] is None and r["op"] is None and r["culprit_samples"] == []
    assert "did not reproduce" in r["summary"] and "another device" in r["summary"]
    assert r["nonfinite_runs"] == 0 and r["repeats"] == 3


def test_culprit_in_the_second_micro_batch(tmp_path: Path) -> None:
    data = models.batches("forward", 6, bad_step=3, bad_pos=6)  # step 1 = micro-batches 2, 3
    models.train(models.make_model("forward"), models.ce_loss, data, tmp_path, accumulation_steps=2)
    (bundle,) = (tmp_path / "captures").glob("step-*")
    r = tg.replay(bundle, models.forward_factory, repeats=2).to_dict()
    assert (r["phase"], r["module"]) == ("forward", "encoder.layers.0.norm")
    assert r["culprit_samples"] == [{"micro_batch": 1, "position": 6, "index": 1030}]


@pytest.mark.timeout(60)
def test_a_finite_loss_with_bad_gradients_in_the_second_micro_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss is finite, the gradients are not, with gradient accumulation: the search for
    the micro-batch whose own gradients are bad ran each micro-batch alone, and each such run
    searched again, without bound (297 s, Python's recursion limit, a plausible output; here
    1704 searches and 41 s)."""
    data = models.batches("backward", 6, bad_step=3, bad_pos=6)  # step 1 = micro 2, 3
    loss = models.loss_of("backward")
    models.train(models.make_model("backward"), loss, data, tmp_path, accumulation_steps=2)
    (bundle,) = (tmp_path / "captures").glob("step-*")
    runs = []
    run = StepRunner.run
    monkeypatch.setattr(
        StepRunner, "run", lambda self, *a, **k: runs.append(1) or run(self, *a, **k)
    )
    r = tg.replay(bundle, models.backward_factory, repeats=2).to_dict()
    assert len(runs) < 60  # each micro-batch searched once per full run, not recursively
    assert (r["phase"], r["op"]) == ("backward", "aten.div")
    assert all(v == v for v in r["replayed"]["losses"])  # the forward loss is finite
    assert r["culprit_samples"] == [{"micro_batch": 1, "position": 6, "index": 1030}]


def test_nondeterministic_step_is_reported(tmp_path: Path) -> None:
    bundle = _capture("backward", tmp_path)  # finite loss, non-finite gradients

    def noisy() -> tg.ReplaySpec:
        model, loss_fn = models.backward_factory()
        calls = iter(range(1000))

        def loss(m: nn.Module, batch: Any) -> Tensor:
            return loss_fn(m, batch) + next(calls) * 1e-3

        return tg.ReplaySpec(model=model, loss_fn=loss)

    r = tg.replay(bundle, noisy, repeats=2, bisect=False).to_dict()
    assert r["reproduced"] is True and r["deterministic"] is False


# -- bad factories and weights ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("no_colon", "expected MODULE:FUNC"),
        ("no_such_module_xyz:make", "cannot import no_such_module_xyz"),
        ("tg_capture_models:missing", "has no attribute 'missing'"),
        ("tg_capture_models:wrong_return_factory", "must return \\(model, loss_fn\\)"),
        ("tg_capture_models:raising_factory", "raised RuntimeError: cannot build"),
    ],
)
def test_bad_factory(factory: str, message: str) -> None:
    with pytest.raises(tg.ReplayError, match=message):
        resolve_factory(factory)


def test_weights_that_do_not_fit(tmp_path: Path) -> None:
    bundle = _capture("forward", tmp_path)
    with pytest.raises(tg.ReplayError, match="do not fit the factory's model"):
        tg.replay(bundle, models.wrong_model_factory)


# -- bisection rule ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [{3}, {0, 6}, {1, 2, 3}, {15}])
def test_bisection_finds_the_bad_samples(bad: set[int]) -> None:
    found = find_culprits(lambda positions: bool(bad & set(positions)), 16)
    assert found.culprits == sorted(bad) and not found.batch_level


def test_bisection_calls_a_batch_level_cause_batch_level() -> None:
    found = find_culprits(lambda positions: True, 16)
    assert found.culprits == [] and found.batch_level and found.runs <= 12


def test_bisection_of_samples_bad_only_together() -> None:
    found = find_culprits(lambda positions: {2, 9} <= set(positions), 16)
    assert found.culprits == [2, 9]


def test_a_batch_level_search_says_whether_samples_were_bad_alone() -> None:
    """Pairs bad only together over more than half the batch: batch-level, but no sample
    was bad alone, so the report must not say "every sample tried is bad on its own"."""
    pairs = [{0, 1}, {2, 3}]
    found = find_culprits(lambda p: any(pair <= set(p) for pair in pairs), 4)
    assert (found.batch_level, found.every_alone) == (True, False)
    everywhere = find_culprits(lambda p: True, 16)
    assert (everywhere.batch_level, everywhere.every_alone) == (True, True)


def test_bisection_claims_nothing_when_its_budget_runs_out() -> None:
    found = find_culprits(lambda positions: {1, 7, 12} <= set(positions), 16, max_runs=20)
    assert found.culprits == [] and not found.complete and not found.batch_level


def test_tracer_ignores_masked_nan_and_names_softmax_of_masked_row(tmp_path: Path) -> None:
    """A NaN made and masked away is not the origin; softmax of an all -inf row is."""
    from trainguard.replay.localize import NonFiniteTracer
    from trainguard.replay.sites import ModuleStack

    model = nn.Linear(3, 3)
    modules = ModuleStack(model)
    tracer = NonFiniteTracer(modules)
    x = torch.ones(2, 3)
    with modules, tracer:
        hidden = torch.where(x > 0, x, torch.zeros(2, 3) / 0.0)  # NaN made, then masked
        scores = model(hidden).masked_fill(torch.tensor([[True] * 3, [False] * 3]), float("-inf"))
        out = torch.softmax(scores, dim=-1).sum()
    origin = tracer.origin_of(out)
    assert origin is not None and origin.kind == "op" and origin.site is not None
    assert origin.site.op == "aten._softmax" and origin.value == "nan"
    assert not origin.inputs_finite


@pytest.mark.parametrize("culprit", [0, 5, 15])
def test_bisection_of_a_loss_that_normalises_over_the_batch(culprit: int) -> None:
    """An advantage divided by the batch's std: a sub-batch of one sample is non-finite
    whichever sample it holds. The culprit is still the one sample (found by removing
    halves), not every sample and not the first one tried alone."""
    found = find_culprits(lambda positions: culprit in positions or len(positions) < 2, 16)
    assert (found.culprits, found.batch_level, found.complete) == ([culprit], False, True)
    assert found.runs <= 10


@pytest.mark.parametrize("culprit", [0, 3, 15])
def test_bisection_of_a_model_that_raises_on_one_sample(culprit: int) -> None:
    """BatchNorm in training mode raises on a batch of one sample (``bad`` returns None):
    the sample whose removal fixes the batch is still named alone, not with a neighbour."""

    def probe(positions: Any) -> bool | None:
        return None if len(positions) < 2 else culprit in positions

    found = find_culprits(probe, 16)
    assert (found.culprits, found.batch_level, found.complete) == ([culprit], False, True)


def test_bisection_of_a_pair_when_one_sample_raises() -> None:
    """Two samples bad only together: with single runs raising, neither is named alone."""

    def probe(positions: Any) -> bool | None:
        return None if len(positions) < 2 else {3, 11} <= set(positions)

    assert find_culprits(probe, 16).culprits == [3, 11]


class _LogBatchNorm(nn.Module):
    """A NaN made in the forward (log of a 0 feature) before a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.bn, self.fc2 = nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(torch.log(x)))))


def _bn_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _bn_batch(bad: int | None) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.rand(8, 4, generator=gen) + 0.1, torch.randn(8, 1, generator=gen)
    if bad is not None:
        x[bad, 1] = 0.0
    return x, y


def test_the_replay_of_a_batchnorm_model_blames_the_op_and_the_sample(tmp_path: Path) -> None:
    """The repeated runs leave BatchNorm's statistics non-finite; the traced run starts from
    the captured (finite) ones, so the verdict is the op and the sample, not the weights."""
    model = _LogBatchNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tg.Guard(model, opt, run_dir=tmp_path) as guard:
        for batch in guard.watch([_bn_batch(None), _bn_batch(3)]):
            loss = _bn_loss(model, batch)
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
    (bundle,) = (tmp_path / "captures").glob("step-*")
    report = tg.replay(bundle, lambda: (_LogBatchNorm(), _bn_loss))
    assert (report.verdict, report.op) == ("numerical", "aten.log")
    assert [s["position"] for s in report.culprit_samples] == [3]
    assert not report.details.get("weights_nonfinite")


@pytest.mark.parametrize("bad", [3, None])
def test_diagnose_leaves_the_buffers_as_they_were(bad: int | None) -> None:
    model = _LogBatchNorm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tg.diagnose(model, _bn_loss, _bn_batch(bad), bisect=True)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


class _Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)


def _ppo_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """A policy-gradient loss with advantages normalised over the batch (PPO's usual)."""
    adv = batch["adv"]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    logp = torch.log_softmax(model.fc(batch["obs"]), -1)[:, 0]
    return -(logp * adv).mean()


def test_the_replay_names_the_sample_of_a_loss_that_normalises_over_the_batch(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = _Policy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    data = [{"obs": torch.randn(16, 4, generator=gen), "adv": torch.randn(16, generator=gen)}]
    data[0]["adv"][5] = float("nan")  # one bad advantage
    with tg.Guard(model, opt, run_dir=tmp_path) as guard:
        for batch in guard.watch(data):
            loss = _ppo_loss(model, batch)
            loss.backward()
            assert not guard.check(loss)
    (bundle,) = (tmp_path / "captures").glob("step-*")
    report = tg.replay(bundle, lambda: (_Policy(), _ppo_loss))
    assert report.verdict == "bad_input"
    assert [s["position"] for s in report.culprit_samples] == [5]


_SCRIPT_WITH_A_BATCH_TYPE = """
import dataclasses, sys
import torch
import trainguard as tg


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


def loss_fn(model, batch):
    return torch.nn.functional.mse_loss(model(batch.x), batch.y)


def make_replay():
    return torch.nn.Linear(4, 1), loss_fn


if __name__ == "__main__":
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [Batch(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    data[1].x[5, 2] = float("nan")
    with tg.Guard(model, opt, run_dir=sys.argv[1]) as guard:
        for batch in guard.watch(data):
            loss = loss_fn(model, batch)
            loss.backward()
            if guard.check(loss):
                opt.step()
            opt.zero_grad()
"""


def test_a_batch_type_of_the_script_is_rebuilt_from_the_factory_file(tmp_path: Path) -> None:
    """The script ran as __main__ (its batch type is ``__main__:Batch`` in the bundle); the
    replay imports it as the factory file, where the type is found and the batch rebuilt
    (it used to come back as a dict: ``'dict' object has no attribute 'x'``)."""
    script = tmp_path / "train_batch_type.py"
    script.write_text(textwrap.dedent(_SCRIPT_WITH_A_BATCH_TYPE))
    argv = sys.argv
    sys.argv = [str(script), str(tmp_path / "run")]
    try:  # as `python train_batch_type.py RUN`: its module is __main__ while it runs
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    (bundle,) = (tmp_path / "run" / "captures").glob("step-*")
    report = tg.replay(bundle, f"{script}:make_replay")
    assert report.verdict == "bad_input"
    assert [s["position"] for s in report.culprit_samples] == [5]


def test_a_batch_type_the_factory_file_lacks_is_named_with_the_fix(tmp_path: Path) -> None:
    """The factory lives in another file that imports the model and loss from the script
    but not its ``Batch``: the batch comes back as a dict, and the error names the type and
    the fix (it said "'dict' object has no attribute 'x'; check that --factory builds the
    model and loss of the training run", blaming the factory)."""
    script = tmp_path / "train_own_batch.py"  # a name no other test imports
    script.write_text(textwrap.dedent(_SCRIPT_WITH_A_BATCH_TYPE))
    (tmp_path / "replay_factory.py").write_text(
        "import torch\n"
        "from train_own_batch import loss_fn  # not Batch\n\n\n"
        "def make_replay():\n"
        "    return torch.nn.Linear(4, 1), loss_fn\n"
    )
    argv = sys.argv
    sys.argv = [str(script), str(tmp_path / "run")]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    (bundle,) = (tmp_path / "run" / "captures").glob("step-*")
    with pytest.raises(tg.ReplayError) as caught:
        tg.replay(bundle, f"{tmp_path / 'replay_factory.py'}:make_replay")
    message = str(caught.value)
    assert (
        "the captured batch holds a Batch (__main__) that the replay could not import, "
        "so it came back as a dict with no attribute 'x'" in message
    )
    assert "import it into the factory's module" in message
    assert "check that --factory" not in message


def test_an_unrebuilt_type_stays_a_plain_container_through_copies() -> None:
    from trainguard.capture import batchcodec, batchtree

    @dataclasses.dataclass
    class Pair:
        x: torch.Tensor

    stored = batchcodec.encode(Pair(torch.ones(2)))
    stored["type"] = "__main__:NoSuchPair"
    batch = batchcodec.decode(stored)
    assert isinstance(batch, dict) and torch.equal(batch["x"], torch.ones(2))
    moved = batchtree.map_tensors(batch, lambda t: t * 2)
    assert type(moved) is type(batch) and torch.equal(moved["x"], torch.full((2,), 2.0))
    with pytest.raises(batchcodec.UnrebuiltTypeError, match="NoSuchPair"):
        _ = moved.x
    assert type(batchcodec.decode(stored, restore_types=False)) is dict
