"""The root-op rule, the path and the roots, and the live API (trace / diagnose)."""

from __future__ import annotations

import nan_cases as nc
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import trainguard as tg
from trainguard.replay.chain import path_of
from trainguard.replay.localize import NonFiniteTracer
from trainguard.replay.report import KEYS
from trainguard.replay.sites import ModuleStack

pytestmark = pytest.mark.timeout(60)


def _traced(fn: object) -> tuple[NonFiniteTracer, Tensor]:
    modules = ModuleStack(nn.Identity())
    tracer = NonFiniteTracer(modules)
    with modules, tracer:
        out = fn()  # type: ignore[operator]
    return tracer, out


def test_the_root_is_the_op_that_made_inf_and_the_nan_maker_is_named_apart() -> None:
    """log(0) = -inf (the root), then 0 * -inf = NaN (the NaN-maker) in a hand-written NLL."""
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    onehot = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    tracer, loss = _traced(lambda: -(onehot * torch.log(probs)).sum())
    hop = tracer.hop_of(loss)
    assert hop is not None and hop.origin.site is not None
    assert (hop.origin.site.op, hop.origin.value, hop.origin.inputs_finite) == (
        "aten.log",
        "-inf",
        True,
    )
    assert hop.nan_maker is not None and hop.nan_maker.site is not None
    assert hop.nan_maker.site.op == "aten.mul"
    assert "aten.mul(0.0, -inf) = nan" in (hop.nan_maker.detail or "")
    ops = [h["op"] for h in path_of(hop)]
    assert ops[0] == "aten.log" and ops[1] == "aten.mul" and ops[-1] == "aten.neg"


def test_a_deliberate_minus_inf_is_no_root() -> None:
    """softmax of a row masked to -inf makes NaN: softmax is the root, not masked_fill."""
    scores = torch.zeros(2, 3).masked_fill(torch.tensor([[True] * 3, [False] * 3]), float("-inf"))
    tracer, out = _traced(lambda: torch.softmax(scores * 1.0, -1).sum())
    origin = tracer.origin_of(out)
    assert origin is not None and origin.site is not None
    assert origin.site.op == "aten.mul" or origin.site.op == "aten._softmax"


def test_every_independent_root_is_reported() -> None:
    def two_roots() -> Tensor:
        a = torch.log(torch.tensor([0.0, 1.0]))  # -inf
        b = torch.tensor([1.0, 2.0]) / torch.tensor([0.0, 1.0])  # inf
        return (a + b).sum()  # -inf + inf = NaN

    tracer, out = _traced(two_roots)
    hop = tracer.hop_of(out)
    assert hop is not None
    assert sorted(r.site.op for r in hop.roots if r.site) == ["aten.div", "aten.log"]
    assert hop.nan_maker is not None and hop.nan_maker.site is not None
    assert hop.nan_maker.site.op == "aten.add"


def test_a_long_path_is_elided_in_the_middle() -> None:
    def long_chain() -> Tensor:
        x = torch.log(torch.zeros(3))
        for _ in range(10):
            x = x * 2.0
        return x.sum()

    tracer, out = _traced(long_chain)
    path = path_of(tracer.hop_of(out))
    assert [h.get("op") for h in path[:3]] == ["aten.log", "aten.mul", "aten.mul"]
    assert path[3] == {"elided": 7} and path[-1]["op"] == "aten.sum"
    assert path[0]["shape"] == [3] and path[0]["dtype"] == "float32"


def test_the_report_has_the_root_op_and_nan_op_in_text_and_json() -> None:
    r = tg.diagnose(*nc.BY_NAME["log_zero"].build())
    d = r.to_dict()
    assert list(d)[: len(KEYS)] == list(KEYS)
    assert (d["op"], d["nan_op"]) == ("aten.log", "aten.mul")
    assert d["roots"][0]["op"] == "aten.log" and len(d["roots"]) == 1
    assert d["path"][0]["op"] == "aten.log" and d["path"][0]["source"].endswith(
        f"nan_cases.py:{nc.root_line('log_zero')}"
    )
    text = str(r)
    assert "op             aten.log" in text and "nan_op         aten.mul" in text
    assert "path           (root first)" in text and "then turned that into NaN" in text


def test_trace_diagnoses_the_step_it_watched() -> None:
    model, loss_fn, batch = nc.BY_NAME["div_zero_norm"].build()
    with tg.trace() as t:
        loss = loss_fn(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
    r = t.diagnose()
    assert isinstance(r, tg.ReplayReport)
    assert (r.reproduced, r.phase, r.op, r.module) == (True, "forward", "aten.div", "pre")
    assert r.source and r.source.endswith(f"nan_cases.py:{nc.root_line('div_zero_norm')}")
    assert r.culprit_samples == [] and r.details["bisected"] is False
    assert "diagnose  a live step" in str(r)


def test_trace_sees_a_backward_only_fault_and_bad_inputs() -> None:
    model, loss_fn, batch = nc.BY_NAME["sqrt_backward"].build()
    with tg.trace() as t:
        loss_fn(model, batch).backward()
    r = t.diagnose()
    assert (r.phase, r.op) == ("backward", "aten.div")
    assert r.details["backward"]["forward_op"] == "aten.sqrt"
    model, loss_fn, batch = nc.BY_NAME["bad_input"].build()
    with tg.trace() as t:
        loss = loss_fn(model, batch)
    r = t.diagnose(loss)
    assert (r.phase, r.verdict) == ("inputs", "bad_input")


def test_trace_of_a_finite_step_says_nothing_to_diagnose() -> None:
    model = nc.Net(nc.Identity())
    with tg.trace() as t:
        F.cross_entropy(model(nc._x(0)), nc._y()).backward()
    r = t.diagnose()
    assert (r.reproduced, r.phase, r.verdict) == (False, None, "not_reproduced")
    assert r.summary.startswith("Nothing to diagnose")


def test_the_report_lists_every_root_in_text_and_json() -> None:
    def two_roots(model: nn.Module, batch: Tensor) -> Tensor:
        h = model(batch)
        return (torch.log(h - h) + 1.0 / (h - h)).sum()  # log(0) = -inf and 1/0 = inf

    r = tg.diagnose(nn.Linear(3, 2), two_roots, torch.ones(4, 3))
    assert [root["op"] for root in r.roots] == ["aten.log", "aten.reciprocal"]
    assert r.nan_op == "aten.add"
    assert "roots          2 independent roots" in str(r)


def test_trace_of_a_given_model_names_its_nonfinite_weights() -> None:
    model, loss_fn, batch = nc.BY_NAME["bad_weights"].build()
    with tg.trace(model) as t:
        loss = loss_fn(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
    r = t.diagnose()
    assert (r.verdict, r.module, r.details["weights_nonfinite"]) == (
        "nonfinite_weights",
        "fc",
        ["fc.weight"],
    )


def test_a_real_cause_is_preferred_to_a_deliberate_minus_inf_on_the_path() -> None:
    def mask_meets_log() -> Tensor:
        mask = torch.tensor([True, False, False])
        masked = torch.zeros(3).masked_fill(mask, float("-inf"))
        return (masked - torch.log(torch.tensor([1.0, 1.0, 0.0]))).sum()  # -inf + inf

    tracer, out = _traced(mask_meets_log)
    hop = tracer.hop_of(out)
    assert hop is not None and hop.origin.site is not None
    assert (hop.origin.kind, hop.origin.site.op) == ("op", "aten.log")
    assert hop.nan_maker is not None and hop.nan_maker.site is not None
    assert hop.nan_maker.site.op == "aten.sum"
