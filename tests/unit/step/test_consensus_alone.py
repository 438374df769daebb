"""A world of one reads its own row directly (issue 26): the same agreement as the rows path."""

from __future__ import annotations

import math

import pytest
import torch

from trainguard.step.consensus import DEVICE_COLUMNS, Consensus, _host_columns, replicated_norm
from trainguard.step.types import LocalReport, Reduced

_VALUES = [
    [0.5, 0.5, 1.25, 3.0, 0.0],
    [math.nan, math.nan, 1.0, 2.0, 7.5],
    [0.5, math.inf, math.nan, 1.0, 0.0],
    [0.5, 0.5, math.inf, -math.inf, 0.0],
    [0.5, 0.5, 2.0, math.nan, 1.0],
]


@pytest.mark.parametrize("values", _VALUES)
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("exhausted", [False, True])
def test_alone_equals_the_rows_path(values: list[float], sharded: bool, exhausted: bool) -> None:
    report = LocalReport(
        torch.tensor(values, dtype=torch.float64),
        exhausted=exhausted,
        batches=17,
        data_time=1.5e-5,
        compute_time=2.5e-5,
    )
    consensus = Consensus(None, torch.device("cpu"))
    found = consensus.agree(report, sharded)
    # what read() builds of one row: the device columns, the host ones, the scale (none) and
    # the leaving and loss_unknown columns
    rows = [*values, *_host_columns(report), 0.0, 0.0, 0.0]  # no scale, not leaving, loss seen
    assert len(rows) > DEVICE_COLUMNS
    expected = consensus.read(rows, Reduced(report.values, report, sharded))
    assert repr(found) == repr(expected)  # NaN-aware: the same text field by field
    assert found.bad == expected.bad and found.where == expected.where
    assert repr(consensus.read(values, Reduced(report.values, report, sharded))) == repr(found)


def test_replicated_norm_is_rank_0s_unless_one_is_not_finite() -> None:
    """DDP's gradients are the same on every rank: rank 0's norm stands for all, but a rank
    whose gradients turned non-finite after the all-reduce makes the step's norm NaN."""
    assert replicated_norm([2.5, 2.5]) == 2.5
    assert replicated_norm([2.5, 2.5000002]) == 2.5  # rank 0's, bit for bit
    assert math.isnan(replicated_norm([2.5, math.nan])) and math.isnan(
        replicated_norm([math.inf, math.nan])
    )
    assert replicated_norm([2.5, math.inf]) == math.inf == replicated_norm([math.inf, 1.0])
    assert replicated_norm([1e308, 1e308]) == 1e308  # the sum overflows; every norm is finite
