"""One test per verdict class, on the classic cases of tests/support/nan_cases.py."""

from __future__ import annotations

import nan_cases as nc
import pytest

import trainguard as tg
from trainguard.replay.divergence import growth
from trainguard.replay.verdicts import ADVICE, VERDICTS

pytestmark = pytest.mark.timeout(60)

SUPPORT = "nan_cases.py"


def _diagnose(name: str) -> dict:  # type: ignore[type-arg]
    case = nc.BY_NAME[name]
    model, loss_fn, batch = case.build()
    history = nc.diverging_run()[3] if name == "divergence" else None
    return tg.diagnose(model, loss_fn, batch, bisect=True, history=history).to_dict()


@pytest.mark.parametrize("case", nc.CASES, ids=lambda c: c.name)
def test_every_classic_case_gets_its_phase_op_module_line_sample_and_verdict(
    case: nc.NanCase,
) -> None:
    r = _diagnose(case.name)
    assert r["verdict"] == case.verdict and r["advice"] == ADVICE[case.verdict]
    assert r["phase"] == case.phase
    if case.op is not None:
        named = [r["op"], (r.get("backward") or {}).get("forward_op")]
        assert any(case.op in (op or "") for op in named), named
    if case.module is not None:
        assert r["module"] == case.module
    if case.line:
        assert r["source"].endswith(f"{SUPPORT}:{nc.root_line(case.name)}")
    if case.sample is not None:
        assert [c["position"] for c in r["culprit_samples"]] == [case.sample]


def test_nonfinite_weights_names_the_parameters() -> None:
    r = _diagnose("bad_weights")
    assert r["weights_nonfinite"] == ["fc.weight"]
    assert r["summary"].startswith("Non-finite weights before the step: fc.weight.")


def test_divergence_says_by_how_much_and_over_how_many_steps() -> None:
    r = _diagnose("divergence")
    grew = r["growth"]
    assert grew["factor"] >= 10 and grew["steps"] >= 3
    assert f"over the last {grew['steps']} steps" in r["summary"]
    assert r["summary"].startswith("The run diverged:")


def test_growth_needs_a_rising_history() -> None:
    flat = [{"step": i, "losses": [1.0], "grad_norm": 2.0} for i in range(10)]
    bad = {"step": 10, "losses": ["nan"], "grad_norm": "inf"}
    assert growth([*flat, bad]) is None
    rising = [{"step": i, "losses": [1.0], "grad_norm": 2.0**i} for i in range(10)]
    found = growth([*rising, bad])
    assert found is not None and found.metric == "grad_norm"
    assert (found.start, found.end, found.steps) == (1.0, 512.0, 10)
    assert growth(None) is None and growth(rising[:2]) is None


def test_a_gradient_norm_at_zero_all_along_is_no_growth() -> None:
    """A single-class cross-entropy (PyTorch's DDP tutorial: one output, loss -0, gradient
    norm 0 at every step) read as an infinite growth from 0 to 0 once, and the replay then
    took the whole step for a divergence and did not look for the bad sample."""
    zero = [{"step": i, "losses": [], "grad_norm": 0.0} for i in range(11)]
    bad = {"step": 11, "losses": [], "grad_norm": "inf"}
    assert growth([*zero, bad]) is None
    rose = [*zero, {"step": 11, "losses": [], "grad_norm": 3.0}, bad]
    found = growth(rose)
    assert found is not None and found.factor == float("inf")  # from 0 it rose: unbounded


@pytest.mark.parametrize("history", ["flat_zero", "diverging"])
def test_a_bad_input_is_searched_for_its_samples_whatever_the_history(history: str) -> None:
    """The batch holding a NaN is a sample's doing: the culprit is bisected for, even after a
    history that grew (the growth is reported, the sample named)."""
    case = nc.BY_NAME["bad_input"]
    model, loss_fn, batch = case.build()
    records = (
        [{"step": i, "losses": [], "grad_norm": 0.0} for i in range(11)]
        if history == "flat_zero"
        else nc.diverging_run()[3][:-1]
    )
    records.append({"step": len(records), "losses": ["nan"], "grad_norm": "nan"})
    r = tg.diagnose(model, loss_fn, batch, bisect=True, history=records).to_dict()
    assert (r["verdict"], r["bisected"]) == ("bad_input", True)
    assert [c["position"] for c in r["culprit_samples"]] == [case.sample]
    assert "not searched" not in r["summary"]
    assert (r.get("growth") is None) == (history == "flat_zero")


def test_overflow_bf16_is_its_own_class() -> None:
    import torch
    from torch import nn

    class Bf16(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x.bfloat16() * 1e38).float()

    model = nc.Net(Bf16())
    r = tg.diagnose(model, nc.ce, (nc._with_sample(nc._x(0), 2, 10.0), nc._y())).to_dict()
    assert (r["verdict"], r["op"], r["module"]) == ("overflow_bf16", "aten.mul", "pre")
    assert "overflowed the range of bfloat16" in r["summary"]


def test_a_finite_step_is_not_reproduced_and_the_model_is_left_as_it_was() -> None:
    import torch

    model = nc.Net(nc.Identity())
    x, y = nc._x(0), nc._y()
    nc.ce(model, (x, y)).backward()  # type: ignore[no-untyped-call]
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    weights = [p.detach().clone() for p in model.parameters()]
    r = tg.diagnose(model, nc.ce, (x, y), bisect=True)
    assert (r.reproduced, r.verdict) == (False, "not_reproduced")
    assert r.verdict in VERDICTS
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters(), strict=True))


def test_a_spikes_replayed_norm_is_set_beside_the_recorded_one_and_the_micro_batch_factor() -> None:
    from trainguard.replay.diagnosis import spike_summary
    from trainguard.replay.stepper import RunResult

    runs = [RunResult(losses=[3.0, 5.0], grad_norm=20.0) for _ in range(3)]
    meta = {"loss": 4.0, "local_grad_norm": 10.0, "rank": 1}
    verdict, text = spike_summary(runs, True, "cpu", meta)
    assert verdict == "spike"
    assert "gradient norm 20; rank 1 recorded 10: 2 micro-batches" in text
    _, same = spike_summary(runs, True, "cpu", {**meta, "local_grad_norm": 20.0})
    assert "recorded 20" not in same  # the same norm: nothing to explain
    # of 2 DDP ranks the recorded norm is the all-reduced gradients', the replay one rank's
    one = [RunResult(losses=[4.0], grad_norm=810.7) for _ in range(3)]
    _, ddp = spike_summary(one, True, "cpu", {**meta, "local_grad_norm": 406.1, "world_size": 2})
    assert (
        "gradient norm 810.7; rank 1 recorded 406.1 after the gradient all-reduce over the 2 "
        "ranks (DDP averages them); the replay's is this rank's own gradients" in ddp
    )
