"""Issue 55's classes on 2 DDP ranks (tests/support/tg_class_cases.py, one spawn):

- a forward overflow the loss never reads, on rank 1's second micro-batch of step 1
  (gradient accumulation): both ranks' losses are finite, DDP's all-reduce spreads the NaN
  gradient to rank 0; the replay finds rank 1 by replaying each rank and names the forward
  op, its module, the backward op where the gradient went NaN, and the micro-batch's sample;
- rows of a grown position table that only rank 1's long sequence reads: the loss is
  non-finite on rank 1 only; the replay names the rows, the sample on rank 1, and that the
  rows were never updated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tg_class_cases as cc
from tg_dist import run_ranks, values

import trainguard as tg

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[Any]]:
    softmax_dir, rows_dir = tmp_path_factory.mktemp("softmax"), tmp_path_factory.mktemp("rows")
    ranks = values(run_ranks(cc.dist_worker, 2, str(softmax_dir), str(rows_dir), timeout=150))
    return softmax_dir, rows_dir, ranks


def test_a_hidden_overflow_on_rank_1s_micro_batch_is_found_there(
    spawned: tuple[Path, Path, list[Any]],
) -> None:
    softmax_dir, _, ranks = spawned
    assert [r["softmax"]["nonfinite_steps"] for r in ranks] == [[1], [1]]
    (bundle,) = cc.captures(softmax_dir)
    assert tg.load_bundle(bundle).trigger == "grad"
    r = tg.replay(bundle, cc.softmax_factory).to_dict()
    assert (r["rank"], r["origin_method"], r["origin_ranks"], r["received_ranks"]) == (
        1,
        "replay",
        [1],
        [0],
    )
    assert (r["verdict"], r["phase"], r["op"], r["module"]) == (
        "numerical",
        "forward",
        "aten.exp",
        "softmax",
    )
    assert [(c["micro_batch"], c["position"]) for c in r["culprit_samples"]] == [(1, 5)]
    assert r["gradient_op"]["grad_fn"] == "DivBackward0"
    assert (
        "in the forward pass, where the loss does not read it (the loss is finite); in the "
        "backward pass aten.div (DivBackward0, the gradient of aten.div in softmax) turned it "
        "into NaN gradients; sample 5 of micro-batch 1 of the batch (dataset index 1029) alone "
        "makes the step non-finite. The non-finite values arose on rank 1: its own forward and "
        "backward reproduce them; rank 0 only received them through the gradient all-reduce "
        "(its own replay is finite)." in r["summary"]
    )


def test_rows_only_rank_1s_sample_reads_are_named_on_rank_1(
    spawned: tuple[Path, Path, list[Any]],
) -> None:
    _, rows_dir, ranks = spawned
    assert [r["rows"]["nonfinite_steps"] for r in ranks] == [[2], [2]]
    (bundle,) = cc.captures(rows_dir)
    r = tg.replay(bundle, cc.position_factory).to_dict()
    assert (r["rank"], r["verdict"], r["op"], r["module"]) == (
        1,
        "nonfinite_rows",
        "aten.embedding",
        "pos",
    )
    assert [(c["micro_batch"], c["position"]) for c in r["culprit_samples"]] == [(0, 3)]
    assert r["weights"]["readers"] == [3] and r["weights"]["updates"]["status"] == "never"
    assert r["summary"].startswith("Non-finite rows before the step: rows 8..15 of pos.weight")
    assert "The loss went non-finite on rank 1; rank 0 only received" in r["summary"]
