"""The row's ``leaving`` column: a rank's caller stops guarding after this step
(``StepCall.leaving``), read per rank into ``Agreement.leaving_ranks``; a world of one reads
its own (the usual step's fast row has no such column: the full measure takes that step).
The cross-rank test: ``tests/distributed/test_leaving_dist.py``. And the column after it,
``loss_unknown`` (``StepCall.loss_known``), read into ``Agreement.unknown_loss_ranks``; its
cross-rank test: ``tests/distributed/test_unknown_loss_dist.py``."""

from __future__ import annotations

from pathlib import Path

import torch
from tg_models import TinyNet

import trainguard as tg
from trainguard.step.consensus import COLUMNS, Consensus, _host_columns
from trainguard.step.types import LocalReport, Reduced


def _rows(leaving: list[bool], unknown: list[bool] | None = None) -> list[float]:
    rows: list[float] = []
    for leaves, unseen in zip(leaving, unknown or [False] * len(leaving), strict=True):
        report = LocalReport(torch.tensor([0.5, 0.5, 1.0, 0.0, 0.0]), leaving=leaves)
        host = _host_columns(report)
        rows += [0.5, 0.5, 1.0, 0.0, 0.0, *host, 0.0, float(leaves), float(unseen)]
    return rows


def test_the_leaving_column_is_read_per_rank() -> None:
    assert COLUMNS[-2:] == ("leaving", "loss_unknown")
    consensus = Consensus(None, torch.device("cpu"))
    consensus.world_size = 3
    report = LocalReport(torch.zeros(5))
    agreement = consensus.read(_rows([False, True, False]), Reduced(report.values, report, False))
    assert agreement.leaving_ranks == [1] and not agreement.bad
    agreement = consensus.read(_rows([False] * 3), Reduced(report.values, report, False))
    assert agreement.leaving_ranks == []


def test_a_world_of_one_reads_its_leaving_from_its_own_row(tmp_path: Path) -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, hang_timeout=0, run_dir=tmp_path)
    for step in range(3):
        loss = model(torch.ones(2, 8)).pow(2).mean()
        loss.backward()
        if step == 1:
            assert guard.internals.check_leaving(None)  # the gradients alone decide
        else:
            assert guard.check(loss)
        assert guard.state.leaving_ranks == ([] if step == 0 else [0])
        opt.zero_grad()
    guard.close()


def test_a_loss_one_rank_did_not_see_is_no_ranks_loss() -> None:
    """The ``loss_unknown`` column (``StepCall.loss_known`` False: ``check_gradients``,
    ``trainguard run`` where no loss was found): when any rank's says so, the agreement's loss
    is unknown on every rank, whatever the others saw."""
    consensus = Consensus(None, torch.device("cpu"))
    consensus.world_size = 3
    report = LocalReport(torch.zeros(5))
    reduced = Reduced(report.values, report, False)
    agreement = consensus.read(_rows([False] * 3, [False, False, True]), reduced)
    assert agreement.unknown_loss_ranks == [2] and not agreement.loss_known
    assert not agreement.bad and agreement.leaving_ranks == []
    agreement = consensus.read(_rows([False] * 3), reduced)
    assert agreement.unknown_loss_ranks == [] and agreement.loss_known
