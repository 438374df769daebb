"""A step whose inputs are sparse tensors (a graph network's node features and adjacency, as
in PyTorch's GCN example): the bad input is found and captured, ``trainguard inspect``
describes the sparse tensors by their stored values, and the replay reproduces the step and
names the input, with the NaN's dense index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import trainguard as tg
from trainguard.capture.inspect import inspect_bundle
from trainguard.replay.render import inspect_text
from trainguard.replay.values import all_finite, first_nonfinite, has_nan

pytestmark = pytest.mark.timeout(60)

NODES, FEATURES, CLASSES = 12, 5, 3


class GraphNet(nn.Module):
    """One graph convolution: ``adj @ (x @ W)``, with ``x`` and ``adj`` sparse."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(FEATURES, CLASSES) * 0.1)

    def forward(self, x: Tensor, adj: Tensor) -> Tensor:
        return torch.log_softmax(torch.sparse.mm(adj, torch.sparse.mm(x, self.weight)), dim=1)


def _loss(model: nn.Module, batch: Any) -> Tensor:
    (x, adj), y = batch
    return nn.functional.nll_loss(model(x, adj), y)


def _factory() -> tuple[nn.Module, Any]:
    return GraphNet(), _loss


def _graph(bad: bool) -> tuple[tuple[Tensor, Tensor], Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = (torch.rand(NODES, FEATURES, generator=gen) < 0.4).float()
    if bad:
        x[3, 2] = float("nan")
    edges = torch.randint(0, NODES, (2, 30), generator=gen)
    adj = torch.sparse_coo_tensor(edges, torch.ones(30), (NODES, NODES)).coalesce()
    adj = (adj + torch.eye(NODES).to_sparse()).coalesce()
    y = torch.randint(0, CLASSES, (NODES,), generator=gen)
    return (x.to_sparse(), adj), y


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("graph")
    torch.manual_seed(0)
    model = GraphNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with tg.Guard(model, optimizer, run_dir=run_dir, hang_timeout=0) as guard:
        for batch in guard.watch([_graph(bad=step == 2) for step in range(4)]):
            loss = _loss(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            if guard.check(loss):
                optimizer.step()
            optimizer.zero_grad()
    (found,) = sorted((run_dir / "captures").glob("step-*"))
    return found


def test_the_nan_of_a_sparse_tensor_is_read_at_its_dense_index() -> None:
    dense = torch.zeros(4, 6)
    dense[1, 4], dense[2, 0] = 1.0, float("nan")
    for sparse in (dense.to_sparse(), dense.to_sparse_csr()):
        assert not all_finite(sparse) and has_nan(sparse)
        index, value, count = first_nonfinite(sparse)
        assert index == [2, 0] and value != value and count == 1
    assert all_finite(torch.ones(3, 3).to_sparse())


def test_inspect_describes_sparse_inputs_by_their_stored_values(bundle: Path) -> None:
    summary = inspect_bundle(bundle)
    leaves = {leaf["path"]: leaf for leaf in summary["per_rank"][0]["batch"][0]["leaves"]}
    x = leaves["[0][0]"]
    assert (x["layout"], x["shape"], x["nan"]) == ("sparse_coo", [NODES, FEATURES], 1)
    assert x["stored"] == x["bytes"] // 4 < NODES * FEATURES
    assert leaves["[0][1]"]["layout"] == "sparse_coo" and leaves["[0][1]"]["nan"] == 0
    assert "sparse_coo" in inspect_text(summary)


def test_the_replay_reproduces_the_step_and_names_the_sparse_input(bundle: Path) -> None:
    report = tg.replay(bundle, _factory, repeats=1).to_dict()
    assert (report["reproduced"], report["verdict"]) == (True, "bad_input")
    assert "nan at [3, 2]" in report["summary"]
