"""The bundle cases of the diagnosis suite: real guarded runs, captured, replayed.

Each returns the case (as in tests/support/nan_cases.py: what a diagnosis should name, and
``build()`` for the tools that need live objects) and trainguard's replay report:

- ``one_off_fault``: a gradient corrupted after backward on one step (rank 0 of 1);
- ``autocast_bundle``: a float16 overflow under the loop's CPU autocast (the guard records
  the autocast state; the other tools run the loop's code, autocast included);
- ``origin_rank``: a 2-rank DDP run whose rank 1 makes sqrt's gradient 0/0 in backward; DDP
  spreads the NaN to rank 0 (the other tools get rank 1's part, which they cannot pick);
- ``replica_mismatch``: a 2-rank DDP run whose rank 1 nudged one weight by +1e-3 (the step
  replays finite; the other tools get rank 1's part).

``extra`` of a case holds ``file`` (the source file its expected line is in) and ``line``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nan_cases as nc  # type: ignore[import-not-found]
import tg_capture_models as models  # type: ignore[import-not-found]
import tg_replay_cases as rcases  # type: ignore[import-not-found]
import torch
from torch import nn

import trainguard as tg
from trainguard.replay.report import ReplayReport

SUPPORT = Path(__file__).resolve().parent.parent / "tests" / "support"


@dataclass
class BundleRow:
    case: Any
    """A ``nan_cases.NanCase``."""
    report: ReplayReport


def _line_of(file: str, needle: str) -> int:
    text = (SUPPORT / file).read_text(encoding="utf-8").splitlines()
    return next(n for n, line in enumerate(text, 1) if needle in line)


def _builder(
    bundle: Path, rank: int, factory: Callable[[], tuple[nn.Module, Any]], loss_fn: Any
) -> Callable[[], tuple[nn.Module, Any, Any]]:
    """Live objects of one rank's part: the factory's model with the bundle's weights."""

    def build() -> tuple[nn.Module, Any, Any]:
        opened = tg.load_bundle(bundle)
        model = factory()[0]
        model.load_state_dict(opened.model_state(rank))
        return model, loss_fn, opened.batches(rank)[0]

    return build


def _case(name: str, description: str, build: Any, *fields: Any, **extra: Any) -> Any:
    return nc.NanCase(name, description, build, *fields, extra=extra)


def one_off_fault() -> BundleRow:
    from trainguard.testing import Fault, FaultPlan

    run_dir = Path(tempfile.mkdtemp(prefix="tg-diagnosis-"))
    data = models.batches("clean", 3, bad_step=-1)
    plan = FaultPlan([Fault(step=1, where="grad")])
    models.train(models.make_model("clean"), models.ce_loss, data, run_dir, plan=plan)
    (bundle,) = (run_dir / "captures").glob("step-*")
    report = tg.replay(bundle, models.clean_factory)
    build = _builder(bundle, 0, models.clean_factory, models.ce_loss)
    description = "a one-off fault after backward (rank 0 of 1)"
    fields = ("none", None, None, False, None, "not_reproduced")
    case = _case("one_off_fault", description, build, *fields)
    return BundleRow(case, report)


def _autocast_ce(model: nn.Module, batch: Any) -> Any:
    with torch.autocast("cpu", dtype=torch.float16):  # the loop's code
        return rcases.ce(model, batch)


def autocast_bundle() -> BundleRow:
    bundle = rcases.train_under_autocast(Path(tempfile.mkdtemp(prefix="tg-diagnosis-")))
    report = tg.replay(bundle, rcases.overflow_factory)
    build = _builder(bundle, 0, rcases.overflow_factory, _autocast_ce)
    line = _line_of("tg_replay_cases.py", "self.head(torch.relu(self.lin(x)))")
    case = _case(
        "autocast_bundle",
        "a float16 overflow under the loop's CPU autocast, captured and replayed",
        build,
        "forward",
        "addmm",
        "lin",
        True,
        5,
        "overflow_fp16",
        file="tg_replay_cases.py",
        line=line,
    )
    return BundleRow(case, report)


def ddp_rows() -> list[BundleRow]:
    """``origin_rank`` and ``replica_mismatch``: two 2-rank DDP runs (one spawn)."""
    from tg_dist import run_ranks, values  # type: ignore[import-not-found]

    origin = Path(tempfile.mkdtemp(prefix="tg-diagnosis-origin-"))
    replica = Path(tempfile.mkdtemp(prefix="tg-diagnosis-replica-"))
    values(run_ranks(rcases.ddp_worker, 2, str(origin), str(replica), timeout=300))
    return [_origin_row(origin / "captures" / "step-00000002"), _replica_row(replica)]


def _origin_row(bundle: Path) -> BundleRow:
    report = tg.replay(bundle, models.backward_factory)
    build = _builder(bundle, 1, models.backward_factory, models.ce_loss)
    line = _line_of("tg_capture_models.py", "torch.sqrt(x.pow(2)")
    case = _case(
        "origin_rank",
        "one sample on rank 1 of 2 (DDP) makes sqrt's gradient 0/0; all-reduced to rank 0",
        build,
        "backward",
        "sqrt",
        "encoder.layers.0.scale",
        True,
        5,
        "numerical",
        file="tg_capture_models.py",
        line=line,
        rank=1,
    )
    return BundleRow(case, report)


def _replica_row(run_dir: Path) -> BundleRow:
    bundle = run_dir / "captures" / "step-00000001"
    report = tg.replay(bundle, models.clean_factory)
    build = _builder(bundle, 1, models.clean_factory, models.ce_loss)
    description = "rank 1 of 2 (DDP) nudged one weight by +1e-3: the replicas differ"
    fields = ("none", None, None, False, None, "replica_mismatch")
    case = _case("replica_mismatch", description, build, *fields)
    return BundleRow(case, report)


def bundle_rows() -> list[BundleRow]:
    return [one_off_fault(), autocast_bundle(), *ddp_rows()]
