"""A world of one folds its row on the host (``step/folded_row.py``): the same decisions and
numbers as the reduced row, with one fused pass and one ``stack`` per check."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tg_ops import OpRecorder
from torch import Tensor, nn

import trainguard as tg
from trainguard.step.folded_row import FoldedRow

NAN, INF = math.nan, math.inf


def _never() -> float:
    raise AssertionError("confirm called with every input norm finite")


def test_unfold_reduces_as_the_device_row_does() -> None:
    row = FoldedRow(losses=1, norms=3, confirm=_never)
    assert row.unfold([2.5, 3.0, 4.0, 0.0, 1.0, 7.0]) == [2.5, 2.5, 5.0, 7.0, 0.0]
    assert FoldedRow(1, 0, _never).unfold([1.0]) == [1.0, 1.0, 0.0, 0.0, 0.0]  # no grads/inputs
    accumulated = FoldedRow(losses=3, norms=1, confirm=_never).unfold([1.0, 2.0, 4.0, 3.0])
    assert accumulated == [7.0 / 3, 7.0, 3.0, 0.0, 0.0]  # mean (reported), sum, norm


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_unfold_propagates_nonfinite_losses_and_norms(bad: float) -> None:
    loss, check, norm, _, _ = FoldedRow(2, 2, _never).unfold([bad, 1.0, 3.0, 4.0])
    assert not math.isfinite(loss) and not math.isfinite(check) and norm == 5.0  # not 1.0
    _, _, norm, _, _ = FoldedRow(1, 2, _never).unfold([1.0, 3.0, bad])
    assert not math.isfinite(norm)
    assert math.isnan(FoldedRow(1, 2, _never).unfold([1.0, INF, NAN])[2])  # NaN wins


def test_a_nonfinite_input_norm_is_confirmed_by_the_exact_column() -> None:
    calls: list[int] = []

    def confirm() -> float:
        calls.append(1)
        return 1e20  # finite: the float32 sum of squares overflowed

    assert FoldedRow(1, 1, confirm).unfold([1.0, 1.0, 2.0, INF])[3] == 1e20
    assert math.isnan(FoldedRow(1, 1, lambda: NAN).unfold([1.0, 1.0, NAN, 2.0])[3])
    assert len(calls) == 1


# -- the guard ---------------------------------------------------------------------------


def _guard_run(
    tmp_path: Path, batches: list[tuple[Tensor, Tensor, Tensor]], **kwargs: Any
) -> tuple[list[bool], list[float], list[list[tuple[str, list[int]]]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).to(batches[0][0].dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = tg.Guard(model, opt, run_dir=tmp_path, hang_timeout=0, **kwargs)
    oks, norms, ops = [], [], []
    for x, y, _aux in guard.watch(batches):  # aux: data the loss does not read
        loss = (model(x) - y).pow(2).mean().float()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.get_total_norm(grads)))
        with OpRecorder() as rec:
            ok = guard.check(loss)
        oks.append(ok)
        ops.append(rec.ops)
        if ok:
            opt.step()
        opt.zero_grad()
    guard.close()
    return oks, norms, ops


def _batches(dtype: torch.dtype = torch.float32, bad: float | None = None) -> list[Any]:
    gen = torch.Generator().manual_seed(1)
    out = [[torch.randn(6, 4, generator=gen) for _ in range(2)] for _ in range(4)]
    if bad is not None:
        out[2][1][3, 1] = bad
    return [(x.to(dtype), x[:, :1].to(dtype), aux.to(dtype)) for x, aux in out]


def _metrics(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "metrics" / "rank-0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_world_of_one_checks_with_one_fused_pass_and_one_read(tmp_path: Path) -> None:
    oks, norms, ops = _guard_run(tmp_path, _batches())
    assert oks == [True] * 4
    for step_ops in ops:
        names = [name for name, _ in step_ops]
        assert names.count("_foreach_norm") == 1, names
        # one stack and one read, or on the CPU the few values read one by one
        # (step/single_process.py)
        reads = names.count("_local_scalar_dense")
        assert (names.count("stack"), reads) in ((1, 0), (0, 1 + 4 + 3)), names
        assert "aminmax" not in names and "linalg_vector_norm" not in names, names
        [(_, sizes)] = [op for op in step_ops if op[0] == "_foreach_norm"]
        assert len(sizes) == 4 + 3  # the 4 gradients and the 3 input tensors, one launch
    logged = [rec["grad_norm"] for rec in _metrics(tmp_path)]
    assert logged == pytest.approx(norms, rel=1e-6)


def test_the_folded_and_the_reduced_row_agree(tmp_path: Path) -> None:
    """float64 data takes the reduced row (it does not fold): the same decisions and norms."""
    folded = _guard_run(tmp_path / "f32", _batches(bad=NAN))
    reduced = _guard_run(tmp_path / "f64", _batches(torch.float64, bad=NAN))
    assert folded[0] == reduced[0] == [True, True, False, True]
    assert all("aminmax" in [n for n, _ in step] for step in reduced[2])  # not folded
    assert folded[1] == pytest.approx(reduced[1], rel=1e-5, nan_ok=True)
    for run in ("f32", "f64"):
        [event] = [
            json.loads(line)
            for line in (tmp_path / run / "events" / "rank-0.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "bad_input"
        ]
        assert event["step"] == 2 and event["tensors"] == [
            {"micro_batch": 0, "path": "[2]", "positions": [3]}
        ]


def test_a_huge_finite_input_is_not_taken_for_a_nonfinite_one(tmp_path: Path) -> None:
    """1e20 squared overflows float32: the folded norm is Inf, the exact check says finite."""
    oks, _, _ = _guard_run(tmp_path, _batches(bad=1e20))
    assert oks == [True] * 4
    lines = (tmp_path / "events" / "rank-0.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["start", "close"]
