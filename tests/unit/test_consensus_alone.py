"""A world of one reads its own row directly (issue 26): the same agreement as the rows path."""

from __future__ import annotations

import math

import pytest
import torch

from trainguard.step.consensus import (
    DEVICE_COLUMNS,
    Consensus,
    LocalReport,
    Reduced,
    _host_columns,
)

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
    rows = [*values, *_host_columns(report)]  # what read() built before (one row)
    assert len(rows) > DEVICE_COLUMNS
    expected = consensus.read(rows, Reduced(report.values, report, sharded))
    assert repr(found) == repr(expected)  # NaN-aware: the same text field by field
    assert found.bad == expected.bad and found.where == expected.where
    assert repr(consensus.read(values, Reduced(report.values, report, sharded))) == repr(found)
